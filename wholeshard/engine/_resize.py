"""Freeing a flat tensor's storage and growing it back in place ([Note: resharding] in
`_storage`): views made while it had storage stay valid, and see what is written once it is
grown back."""

from __future__ import annotations

import torch


def allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().size() > 0


def alloc(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


def free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)
