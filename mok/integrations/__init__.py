"""mok inside training frameworks.

- `mok.integrations.transformers`: importing it registers ``"mok"`` as a Hugging Face
  transformers experts implementation (``experts_implementation="mok"``).
- `mok.integrations.torchtitan`: a TorchTitan override of the MoE layer's routed experts,
  selected with ``--override.imports mok.integrations.torchtitan``.

Neither framework is a dependency of mok: each module imports its framework when it is imported.
"""
