"""Early exit without training: the target's first L decoder layers, its final norm and LM
head, sharing the target's weights (no copy)."""

from __future__ import annotations

import copy

import torch
from redraft.decoder import block_linear
from redraft.decoder.drafter import UnknownDrafter


def decoder_layers(model) -> tuple[str, torch.nn.ModuleList]:
    """The body's stack of decoder layers (Llama/Qwen2 `layers`, GPT-2 `h`) and its name."""
    body = model.base_model
    count = getattr(model.config, "num_hidden_layers", None)
    for name, child in body.named_children():
        if isinstance(child, torch.nn.ModuleList) and len(child) == count:
            return name, child
    raise UnknownDrafter(f"--draft-model skip:L: cannot find the decoder layers of a "
                         f"{type(model).__name__}")


def first_layers(target, layers: int):
    """The target's first `layers` layers + final norm + LM head, sharing its weights.

    Built as a model of the target's own class with a shallower config, on the meta device
    (nothing allocated), whose every submodule is then the target's own.
    """
    name, stack = decoder_layers(target)
    if layers >= len(stack):
        raise UnknownDrafter(f"--draft-model skip:{layers}: the target has only {len(stack)} "
                             "layers; a draft model must skip some")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):
        model = type(target)(config)
    body, target_body = model.base_model, target.base_model
    for child, _ in list(body.named_children()):
        setattr(body, child, getattr(target_body, child))
    setattr(body, name, torch.nn.ModuleList(list(stack)[:layers]))
    model.set_output_embeddings(target.get_output_embeddings())
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise UnknownDrafter(f"--draft-model skip:L: cannot share {leftover[0]} with the target")
    block_linear.share(target, model)  # its verifier runs on the target's blocks too
    return model.eval()
