"""Launch settings every kernel family shares, read from the environment (no Triton import here).
The runtime's own are in attn/kernels/runtime.py (ATTNLAB_KERNEL_CONFIG, ATTNLAB_DIRECT_LAUNCH, ATTNLAB_TMA,
ATTNLAB_DECODE_SPLITS, ATTNLAB_INTERPRET_BLOCKS); family-specific ones stay in their modules
(ATTNLAB_FIXED_SHIFT, ATTNLAB_SOFTMAX_DQ, ATTNLAB_DIFF_DKDV, ATTNLAB_SIGMOID_PATH)."""

from __future__ import annotations

import os

# os.environ.get costs a microsecond or more (an encode, a decode and the Mapping machinery) and the
# launch path reads a dozen settings per call; on POSIX CPython os.environ keeps its bytes in `_data`,
# which every os.environ / monkeypatch.setenv change updates, so a lookup there sees the same values
_RAW_ENVIRON = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENCODED_NAMES: dict[str, bytes] = {}


def setting(name: str, default: str | None = None) -> str | None:
    """os.environ.get(name, default), read at a dict lookup's cost where the platform allows."""
    if _RAW_ENVIRON is None:
        return os.environ.get(name, default)
    key = _ENCODED_NAMES.get(name)
    if key is None:
        key = _ENCODED_NAMES[name] = os.fsencode(name)
    raw = _RAW_ENVIRON.get(key)
    return default if raw is None else os.fsdecode(raw)

_ENCODED_GROUPS: dict[tuple[str, ...], tuple] = {}


def settings_values(names: tuple[str, ...]) -> tuple:
    """The raw values of several settings at once (None where unset), for keys of what was built from
    them; as cheap as `setting` per name."""
    if _RAW_ENVIRON is None:
        return tuple(os.environ.get(name) for name in names)
    keys = _ENCODED_GROUPS.get(names)
    if keys is None:
        keys = _ENCODED_GROUPS[names] = tuple(os.fsencode(name) for name in names)
    return tuple(map(_RAW_ENVIRON.get, keys))


# "0": no timing; every kernel runs one fixed tile config, the first unless the family lets an
# environment variable pick it (`attn.pin_kernel_configs`, deterministic=true)
PIN_ENV = "ATTNLAB_AUTOTUNE"


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1, the CPU tests): one config, no timing."""
    return setting("TRITON_INTERPRET") == "1"


def autotune_pinned() -> bool:
    """Pinned to one config, so two processes sum in the same order (read at each tuning)."""
    return setting(PIN_ENV, "1") == "0"
