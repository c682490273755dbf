"""Medusa heads, one module per job: `blocks` (the heads' layers), `heads_file` (reading,
writing and checking a heads file), `committed` (the heads shipped for known models, this
folder's `NAME.safetensors`), `predictor` (each head's top-k at inference, int8 on a CPU),
`tree_shape` (the drafting tree shaped by held-out accuracies) and training
(`training_data`, `hidden_cache`, `training`: `redraft train-medusa`).
The `medusa`, `hybrid` and `fallback` drafters draft with them.
"""
