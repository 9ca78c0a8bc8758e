"""Where a model's tensors live: the device and dtype a config names, and handing freed memory back."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch


def resolve_device(device: str | None) -> torch.device:
    """``auto``/None is cuda when available, else cpu."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on GPU and float32 on CPU (config ``model.dtype``)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def release_freed_memory(device: torch.device) -> None:
    """Hand freed tensor memory back to the system: the CUDA cache, or on CPU glibc's free lists
    (``malloc_trim``), which otherwise keep large freed blocks inside the process's resident set."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    libc = ctypes.util.find_library("c")
    if libc is not None and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)
