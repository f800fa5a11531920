"""Schedule-independent model randomness: dropout keyed by (seed, iteration, microbatch, layer).

Megatron's dropout draws from one random stream per rank in execution order, so a schedule that runs microbatches
in another order (or another P, V) gives other masks, and other losses. Here every transformer layer (and the
embedding, as layer 0) reseeds the default generator, and Megatron's model-parallel stream, from its key just
before it runs. The same key gives the same masks on any rank, in any order, and again when activation
recomputation reruns a layer, or its core attention, in the backward pass (recompute_randomness.py restores the
microbatch and layer its forward ran). The executor names the microbatch of every task it runs, forward and
backward; outside the executor (Megatron's own schedules) the microbatch Megatron's forward_step sets on the layers
(``current_microbatch``) is used.

Each layer borrows the generators: their state before the layer is put back after it, so code that draws
between layers or after the forward (data sampling, Megatron's own streams) sees the stream it would see without
keyed randomness.

Use: ``enable_keyed_randomness(model_chunks, seed)`` once; ``set_iteration(i)`` before each training step (left
out, the iteration advances by one after each training forward_backward call). The KeyedRandomness lives on the
current job (job.py); the executor takes it from the job it is handed, once per call.

Variable-length documents (a composition may regroup them into other microbatches, padded or packed): the loop says
which documents each microbatch of the next call holds (``set_microbatch_documents``), and the dropout of our core
attention (CPU and CUDA), hidden dropout and embedding dropout (train/document_dropout.py) then draw from ``document_generators``:
one generator per (seed, document, layer, stream), drawn in position order over the whole document, so a mask
depends on the document and the position in it, never on the microbatch or the row it landed in.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_app.schedule.iteration_plan import DocumentSegment  # noqa: F401 (the layout's one definition)

from .job import current_job

_KEY_BITS = 63


class KeyedRandomness:
    def __init__(self, seed: int):
        self.seed = seed
        self.iteration = 0
        self._iteration_set = False
        self.microbatch: Optional[int] = None   # set by the executor around each task
        self._handles: List = []
        self._borrowed: List = []  # generator states saved by reseed(), restored by give_back()
        self.microbatch_documents: Optional[Tuple[Tuple[DocumentSegment, ...], ...]] = None   # of the next call
        self.current: Optional[Tuple[int, int]] = None   # (microbatch, layer) of the layer running now
        # the microbatch of the transformer block running now: set when a block starts, and by a recomputation to
        # the one its forward ran (recompute_randomness.py)
        self.block_microbatch: Optional[int] = None

    def key(self, microbatch: int, layer: int, stream: str) -> int:
        text = f"{self.seed}:{self.iteration}:{microbatch}:{layer}:{stream}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> (64 - _KEY_BITS)

    def document_key(self, document: int, layer: int, stream: str) -> int:
        text = f"{self.seed}:document{document}:{layer}:{stream}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> (64 - _KEY_BITS)

    def reseed(self, microbatch: Optional[int], layer: int) -> None:
        if microbatch is None:
            raise RuntimeError(f"keyed randomness: layer {layer} runs with no microbatch known; run it through "
                               "forward_backward_app or Megatron's forward_step")
        self.current = (microbatch, layer)
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import random as megatron_random

        tracker = megatron_random.get_cuda_rng_tracker()
        name = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME
        cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None
        self._borrowed.append((torch.get_rng_state(), cuda_state, tracker, tracker.get_states()))
        if name in tracker.get_states():
            # Megatron's per-TP-rank stream (its attention dropout on CUDA): keyed too, with the TP rank in it.
            tp_rank = parallel_state.get_tensor_model_parallel_rank() \
                if parallel_state.model_parallel_is_initialized() else 0
            with tracker.fork(name):
                torch.manual_seed(self.key(microbatch, layer, f"tp{tp_rank}"))
        torch.manual_seed(self.key(microbatch, layer, "default"))

    def give_back(self) -> None:
        """Restore the generator states the last reseed() found (after its layer ran)."""
        if not self._borrowed:
            return
        cpu_state, cuda_state, tracker, tracker_states = self._borrowed.pop()
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)
        tracker.set_states(tracker_states)

    def recompute_context(self) -> Tuple[Optional[int], Optional[Tuple[int, int]]]:
        """What keys the randomness of a part that runs now, for its recomputation in the backward pass."""
        return self.block_microbatch, self.current

    def restore_recompute_context(self, context: Tuple[Optional[int], Optional[Tuple[int, int]]]) -> None:
        self.block_microbatch, self.current = context

    @contextlib.contextmanager
    def microbatch_scope(self, microbatch: int):
        """The executor runs every task (forward, and backward with its recomputation) inside this."""
        outer, self.microbatch = self.microbatch, microbatch
        try:
            yield
        finally:
            self.microbatch = outer

    def set_microbatch_documents(self, microbatches: Sequence[Sequence[DocumentSegment]]) -> None:
        self.microbatch_documents = tuple(tuple(segments) for segments in microbatches)

    def document_generators(self, stream: str, device=None) -> Optional[List[Tuple[DocumentSegment, torch.Generator]]]:
        """One generator per document of the running layer's microbatch, on ``device`` (CPU by default): a CUDA
        generator seeded with the same key draws the same bits on any layout of one device type (its Philox
        offsets depend on the draw's shape alone), without drawing on the host and copying."""
        if self.microbatch_documents is None or self.current is None:
            return None
        microbatch, layer = self.current
        if microbatch >= len(self.microbatch_documents):
            raise RuntimeError(f"keyed randomness: microbatch {microbatch} has no documents set "
                               f"({len(self.microbatch_documents)} microbatches were)")
        device = torch.device("cpu") if device is None else torch.device(device)
        return [(segment, torch.Generator(device=device).manual_seed(self.document_key(segment.document, layer,
                                                                                        stream)))
                for segment in self.microbatch_documents[microbatch]]

    def training_call_done(self) -> None:
        if not self._iteration_set:
            self.iteration += 1
        self._iteration_set = False

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _chunk_layers(chunk: torch.nn.Module):
    """(embedding or None, transformer block, its layers) of one model chunk, unwrapping DDP / Float16 wrappers."""
    from megatron.core.utils import get_attr_wrapped_model

    model = get_attr_wrapped_model(chunk, "decoder", return_model_obj=True)
    embedding = getattr(model, "embedding", None) if getattr(model, "pre_process", False) else None
    return embedding, model.decoder, list(model.decoder.layers)


def enable_keyed_randomness(model_chunks, seed: int) -> KeyedRandomness:
    """Key every layer's randomness of these chunks by (seed, iteration, microbatch, layer), for the current job;
    replaces an earlier call's hooks."""
    from . import recompute_randomness

    recompute_randomness.install()   # a recomputed layer redraws its forward's masks
    disable_keyed_randomness()
    state = KeyedRandomness(seed)
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for chunk in chunks:
        embedding, block, layers = _chunk_layers(chunk)

        def running_microbatch(layers=layers):
            if state.block_microbatch is not None:
                return state.block_microbatch
            if state.microbatch is not None:
                return state.microbatch
            return layers[0].current_microbatch if layers and hasattr(layers[0], "current_microbatch") else None

        def hook_for(layer_number: int):
            def reseed(module, args):
                state.reseed(running_microbatch(), layer_number)
            return reseed

        def block_starts(module, args, running_microbatch=running_microbatch):   # blocks never nest
            state.block_microbatch = running_microbatch()

        def block_ends(module, args, output):
            state.block_microbatch = None

        state._handles.append(block.register_forward_pre_hook(block_starts))
        state._handles.append(block.register_forward_hook(block_ends, always_call=True))

        def give_back(module, args, output):
            state.give_back()

        for layer_number, module in ([(0, embedding)] if embedding is not None else []) + \
                [(layer.layer_number, layer) for layer in layers]:
            state._handles.append(module.register_forward_pre_hook(hook_for(layer_number)))
            # always_call: a layer that raises gives the generators back too
            state._handles.append(module.register_forward_hook(give_back, always_call=True))
    current_job().keyed_randomness = state
    return state


def disable_keyed_randomness() -> None:
    job = current_job()
    if job.keyed_randomness is not None:
        job.keyed_randomness.close()
        job.keyed_randomness = None


def set_iteration(iteration: int) -> None:
    """The loop's number of the next training step: its dropout keys (a resumed run continues its masks) and its
    trace iteration (counted from 1, as the trainer's log)."""
    current_job().tell_iteration(iteration)
    state = current_job().keyed_randomness
    if state is not None:
        state.iteration = iteration
        state._iteration_set = True


def microbatch_scope(microbatch: int):
    """KeyedRandomness.microbatch_scope of the current job (a no-op without keyed randomness)."""
    state = current_job().keyed_randomness
    return contextlib.nullcontext() if state is None else state.microbatch_scope(microbatch)


def set_microbatch_documents(microbatches: Sequence[Sequence[DocumentSegment]]) -> None:
    """The documents each microbatch of the next forward_backward call holds (no-op without keyed randomness)."""
    state = current_job().keyed_randomness
    if state is not None:
        state.set_microbatch_documents(microbatches)


def document_generators(stream: str, device=None) -> Optional[List[Tuple[DocumentSegment, torch.Generator]]]:
    """For the layer running now, one generator per document of its microbatch (on ``device``, CPU by default),
    keyed by (seed, document, layer, stream); None when no document layout is known (the caller draws as before)."""
    state = current_job().keyed_randomness
    return None if state is None else state.document_generators(stream, device)
