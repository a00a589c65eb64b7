"""The original Mixture-of-Kittens' raw op set, for code written against it.

`ops` registers the original's raw ops (`mok::<name>` custom ops with the original's argument
lists, outputs and mutated arguments; `mok.ops` re-exports them), `checks` their argument
checks, `slot_passes` their bodies over mok's launchers. Importing this package imports none
of them.
"""
