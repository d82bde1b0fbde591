"""Training SeKV's router against the frozen model's own full-KV behaviour (docs/DESIGN.md §5.6).

`data` makes training samples locally (stdlib docstrings, disjoint from the evaluation's pydoc
haystacks, and retrieval questions on seeds the evaluation never uses); `teacher` runs the frozen
model with full KV and records what the student needs; `student` is the differentiable SeKV
memory the router is trained through; `trainer` holds the loop, checkpoints and resume.
"""
