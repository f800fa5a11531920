"""Deferred weight gradients: how autograd nodes take part in a split backward (runtime/split_backward.py).

While a split backward's B runs (inside `deferring(products, nodes)`), a node that computes an input and a weight
gradient in one call (Megatron's local linear layers, the emulated chunks) computes only the input gradient and
appends a DeferredProduct: the tensors its weight gradient needs, and where that gradient goes (the weights' AccumulateGrad
nodes). W computes the products later and sends them through those nodes, so hooks on them (Megatron's DDP) run as
after a whole backward. A node says which of its input edges it defers through `register(backward_class, rule)`;
the B driver reads the same rule to leave those weights out of B, so both always agree.

Outside runtime/ and emulation/ so that both use it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

import torch
from torch.autograd.graph import GradientEdge

DeferredEdgesRule = Callable[[object], Tuple[int, ...]]


@dataclass
class DeferredProduct:
    """One node's weight gradients, computed in W: compute() returns one gradient per edge."""

    edges: Tuple[GradientEdge, ...]
    compute: Callable[[], Sequence[torch.Tensor]]
    kept: Tuple[torch.Tensor, ...]     # the activations kept alive for compute() (memory accounting)


_rules: Dict[type, DeferredEdgesRule] = {}   # the vocabulary of deferrable node types, filled at import / install

# Set on each deferring node for the duration of its B: the list its product goes to. Kept on the node, not in a
# module global, so no process-wide state says which backward is a B.
_DEFERRED_INTO = "_megatron_app_deferred_into"


def register(backward_class: type, rule: DeferredEdgesRule) -> None:
    """Nodes of `backward_class` defer the weight gradients of the input edges `rule(node)` names (indices into
    node.next_functions; empty: this node computes everything itself)."""
    _rules[backward_class] = rule


def deferred_edges(node) -> Tuple[int, ...]:
    rule = _rules.get(type(node))
    return () if rule is None else rule(node)


def leads_to_weight(node, index: int) -> bool:
    """Whether input edge `index` of `node` goes straight to a leaf's AccumulateGrad (a weight to defer)."""
    target = node.next_functions[index][0]
    return target is not None and hasattr(target, "variable")


@contextlib.contextmanager
def deferring(products: List[DeferredProduct], nodes: Iterable):
    """Inside: `nodes` (the deferring nodes of B's graph, found before B ran) append their weight-gradient products
    to `products`. Other nodes, e.g. those a reentrant recomputation builds during B, compute everything."""
    nodes = list(nodes)
    for node in nodes:
        setattr(node, _DEFERRED_INTO, products)
    try:
        yield
    finally:
        for node in nodes:
            delattr(node, _DEFERRED_INTO)


def defers(node) -> bool:
    """Whether the running backward is a split backward's B that defers this node's weight gradients."""
    return getattr(node, _DEFERRED_INTO, None) is not None


def defer(node, compute: Callable[[], Sequence[torch.Tensor]], kept: Sequence[torch.Tensor]) -> None:
    """Called by a node during B, when defers(node): record its deferred product."""
    edges = tuple(GradientEdge(node.next_functions[i][0], node.next_functions[i][1]) for i in deferred_edges(node))
    getattr(node, _DEFERRED_INTO).append(DeferredProduct(edges, compute, tuple(kept)))
