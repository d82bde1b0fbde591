"""Converters (importable as `sekv_local.converters`): HF checkpoints -> GGUF and router baking.

The converters themselves arrive with the training issue; the package exists so that the layout
(and its import path in normal and editable installs) is fixed from the start.
"""
