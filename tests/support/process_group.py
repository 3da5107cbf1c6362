"""Closing the default process group of a script's rank before the interpreter exits."""

from __future__ import annotations

import gc

import torch.distributed as dist

__all__ = ["close_process_group"]


def close_process_group() -> None:
    """Collect what still holds the group (a trainer, its DDP model) and destroy it, if one is open.

    Hugging Face's Trainer and Accelerate leave the group open after training; its gloo threads
    then run into the interpreter's exit, where destroying them while joinable aborts a rank
    that finished its work ("terminate called without an active exception").
    """
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
