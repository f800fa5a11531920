"""Synthetic documents whose microbatches a file gives: real compute on compositions chosen beforehand.

A cost curve (sim/cost_curves.py) is only as good as the compositions its trace saw: a corpus composed by `balanced`
gives microbatches of near-equal tokens, a narrow range. `--synthetic-microbatches FILE` trains instead on documents
of random tokens whose every iteration's microbatches the file lists, as document lengths:

    {"iterations": [[[8192], [64, 64]], [[1024, 1024, 2048, 4096], [300, 300]]]}

(a bare list of iterations is read too). Every iteration holds the same number of documents (the global batch);
microbatches are packed (one row, attention within each document); iterations repeat when the run is longer.
`sweep_iterations` writes a design that spans a token range and a range of documents per microbatch.

Sample i of the dataset is document i % G of iteration (i // G) % N (G documents an iteration, N iterations in the
file), its tokens drawn with the run's seed and i, so every rank reads the same documents and a layout change (P, V)
trains on the same batches.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy
import torch

Microbatch = Tuple[int, ...]            # the document lengths of one microbatch (training positions each)
Iteration = Tuple[Microbatch, ...]


class SyntheticPlanError(ValueError):
    """A synthetic-microbatches file that cannot be trained on (one line)."""


@dataclass(frozen=True)
class SyntheticPlan:
    iterations: Tuple[Iteration, ...]

    @property
    def documents_per_iteration(self) -> int:
        return sum(len(microbatch) for microbatch in self.iterations[0])

    def iteration(self, index: int) -> Iteration:
        return self.iterations[index % len(self.iterations)]

    @property
    def longest_document(self) -> int:
        return max(length for iteration in self.iterations for microbatch in iteration for length in microbatch)

    @property
    def tokens_range(self) -> Tuple[int, int]:
        tokens = [sum(microbatch) for iteration in self.iterations for microbatch in iteration]
        return min(tokens), max(tokens)

    @property
    def documents_range(self) -> Tuple[int, int]:
        counts = [len(microbatch) for iteration in self.iterations for microbatch in iteration]
        return min(counts), max(counts)

    def to_json(self) -> dict:
        return {"iterations": [[list(microbatch) for microbatch in iteration] for iteration in self.iterations]}


def parse_plan(data) -> SyntheticPlan:
    """A plan from the file's JSON, or SyntheticPlanError saying what is wrong."""
    iterations = data.get("iterations") if isinstance(data, dict) else data
    if not isinstance(iterations, list) or not iterations:
        raise SyntheticPlanError('expected {"iterations": [...]}: a non-empty list of iterations, each a list of '
                                 'microbatches, each a list of document lengths')
    parsed: List[Iteration] = []
    for number, iteration in enumerate(iterations, 1):
        if not isinstance(iteration, list) or not iteration:
            raise SyntheticPlanError(f"iteration {number} is not a non-empty list of microbatches")
        microbatches = []
        for microbatch in iteration:
            if (not isinstance(microbatch, list) or not microbatch
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in microbatch)):
                raise SyntheticPlanError(f"iteration {number}: a microbatch must be a non-empty list of positive "
                                         f"integer document lengths, got {microbatch!r}")
            microbatches.append(tuple(microbatch))
        parsed.append(tuple(microbatches))
    plan = SyntheticPlan(tuple(parsed))
    counts = {sum(len(m) for m in iteration) for iteration in plan.iterations}
    if len(counts) > 1:
        raise SyntheticPlanError(f"every iteration must hold the same number of documents (the global batch), got "
                                 f"{sorted(counts)}")
    return plan


def read_plan(path: str) -> SyntheticPlan:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except OSError as error:
        raise SyntheticPlanError(f"cannot read it ({error.strerror or error})") from None
    except ValueError as error:
        raise SyntheticPlanError(f"not JSON ({error})") from None
    return parse_plan(data)


def sweep_iterations(min_tokens: int, max_tokens: int, max_documents: int, iterations: int,
                     documents_per_iteration: int = 16, seed: int = 0) -> SyntheticPlan:
    """A design over microbatch tokens (log-uniform in [min_tokens, max_tokens]) and documents per microbatch
    (powers of two up to max_documents): iteration k splits its documents into microbatches of one count, cycling
    through the counts (1, 2, 4, ...), so every count appears with every size; a microbatch's tokens are split among
    its documents at random (each at least 1), so equal tokens come with different squared tokens too."""
    if not 1 <= min_tokens <= max_tokens:
        raise SyntheticPlanError(f"the token range must satisfy 1 <= min <= max, got {min_tokens}..{max_tokens}")
    counts = [2 ** p for p in range(int(math.log2(max(1, max_documents))) + 1)
              if 2 ** p <= documents_per_iteration and 2 ** p <= min_tokens]
    if not counts or iterations < 1:
        raise SyntheticPlanError("a sweep needs at least one iteration and one document per microbatch")
    rng = numpy.random.RandomState(seed)
    planned: List[Iteration] = []
    for number in range(iterations):
        documents = counts[number % len(counts)]
        sizes = [documents] * (documents_per_iteration // documents)
        sizes[-1] += documents_per_iteration - sum(sizes)     # G not a multiple: the last takes the rest
        microbatches = []
        for size in sizes:
            tokens = int(round(math.exp(rng.uniform(math.log(max(min_tokens, size)), math.log(max_tokens)))))
            cuts = numpy.sort(rng.choice(numpy.arange(1, tokens), size - 1, replace=False)) if size > 1 else []
            bounds = [0, *[int(c) for c in cuts], tokens]
            microbatches.append(tuple(bounds[i + 1] - bounds[i] for i in range(size)))
        planned.append(tuple(microbatches))
    return SyntheticPlan(tuple(planned))


class SyntheticDocuments:
    """The training dataset of a plan: sample i is one document of random tokens (ids below the end-of-document
    id, as a corpus's), the sample format of DocumentDataset; `groups_at` says how a global batch forms its
    microbatches."""

    def __init__(self, plan: SyntheticPlan, seed: int, vocab_size: int, num_samples: int):
        self.plan = plan
        self.seed = seed
        self.vocab_size = vocab_size
        self.num_samples = num_samples
        self.per_iteration = plan.documents_per_iteration

    def __len__(self) -> int:
        return self.num_samples

    def sample_length(self, index: int) -> int:
        position = index % self.per_iteration
        for microbatch in self.plan.iteration(index // self.per_iteration):
            if position < len(microbatch):
                return microbatch[position]
            position -= len(microbatch)
        raise AssertionError("a plan's iterations all hold documents_per_iteration documents")

    def groups_at(self, first_sample: int) -> Tuple[Tuple[int, ...], ...]:
        """The microbatches of the global batch starting at first_sample, as positions in it."""
        if first_sample % self.per_iteration:
            raise ValueError(f"sample {first_sample} does not start a global batch of {self.per_iteration}")
        groups, start = [], 0
        for microbatch in self.plan.iteration(first_sample // self.per_iteration):
            groups.append(tuple(range(start, start + len(microbatch))))
            start += len(microbatch)
        return tuple(groups)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        length = self.sample_length(index)
        rng = numpy.random.RandomState([self.seed, index])
        ids = torch.from_numpy(rng.randint(0, self.vocab_size - 1, length + 1).astype(numpy.int64))
        return {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": torch.ones(length, dtype=torch.float),
                "position_ids": torch.arange(length, dtype=torch.int64)}


def check_against(plan: SyntheticPlan, seq_length: int) -> None:
    """A plan the model can run: no document over --seq-length (its position embeddings end there)."""
    if plan.longest_document > seq_length:
        raise SyntheticPlanError(f"a document of {plan.longest_document} tokens is longer than --seq-length "
                                 f"{seq_length}")


def main(argv=None) -> int:
    """python -m megatron_app.data.synthetic_documents --output FILE [--tokens MIN,MAX] ...: write a sweep."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megatron_app.data.synthetic_documents",
                                     description="Write a sweep of microbatch compositions for the trainer's "
                                                 "--synthetic-microbatches (sweep_iterations).")
    parser.add_argument("--output", required=True, help="the JSON file to write")
    parser.add_argument("--tokens", default="128,8192", metavar="MIN,MAX", help="tokens a microbatch (log-uniform)")
    parser.add_argument("--max-documents", type=int, default=16, help="most documents a microbatch (powers of two)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=16, help="documents an iteration")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        low, high = (int(v) for v in args.tokens.split(","))
        plan = sweep_iterations(low, high, args.max_documents, args.iterations, args.global_batch_size, args.seed)
    except ValueError as error:    # SyntheticPlanError included
        parser.error(str(error) if isinstance(error, SyntheticPlanError) else f"--tokens {args.tokens!r}: {error}")
    with open(args.output, "w") as handle:
        json.dump(plan.to_json(), handle)
    print(f"{args.output}: {len(plan.iterations)} iterations of {plan.documents_per_iteration} documents; tokens a "
          f"microbatch {plan.tokens_range[0]}..{plan.tokens_range[1]}, documents {plan.documents_range[0]}.."
          f"{plan.documents_range[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
