"""Parameter names that changed, for checkpoints written before: one table, read by every loader.

The MoE's expert weights carry their shapes in their names (docs/design.md, "Names and shapes"). An
expert's hidden width was once written H, a letter that now means image height only: `w_gate_EDH`
became `w_gate_EDF`. A DeepSpeed checkpoint, an `init_from` source and a `final/` export written
before still load: `torch.nn.Module.load_state_dict` through the MoE's pre-hook
(`rename_legacy_keys`), transformers' `from_pretrained` through `KEY_MAPPING` (it fills parameters
without `load_state_dict`), and the readers that see the stored names (the export check,
`init_from`'s checkpoint reader) through `current_key`.
"""

from __future__ import annotations

# stored name of a parameter (the last part of its key) -> its name today
RENAMED = {
    "w_gate_EDH": "w_gate_EDF",
    "w_up_EDH": "w_up_EDF",
    "w_down_EHD": "w_down_EFD",
    "adj_gate_GDH": "adj_gate_GDF",
    "adj_up_GDH": "adj_up_GDF",
    "adj_down_GHD": "adj_down_GFD",
}

# transformers' `from_pretrained(key_mapping=...)`: regular expressions over the stored keys
KEY_MAPPING = {rf"\.{old}$": f".{new}" for old, new in RENAMED.items()}


def current_key(key: str) -> str:
    """`key` under today's names (a key that was never renamed comes back as it is)."""
    head, dot, last = key.rpartition(".")
    return head + dot + RENAMED.get(last, last)


def current_keys(state: dict) -> dict:
    """A state dict under today's names."""
    return {current_key(k): v for k, v in state.items()}


def rename_legacy_keys(module, state_dict: dict, prefix: str, *args) -> None:
    """A `load_state_dict` pre-hook: the module's stored keys under their old names take today's."""
    for old, new in RENAMED.items():
        if prefix + old in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)
