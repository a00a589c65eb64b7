"""Device helpers (`@cute.jit` functions and constants) shared by every kernel and phase of
every architecture: no kernel class lives here (whole kernels: kernels/, sm90/)."""
