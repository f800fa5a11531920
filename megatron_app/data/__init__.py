"""Corpus preparation and the data side of training: document and paragraph splitting, tokenizer training and
loading, preprocessing into Megatron's indexed format (and its checks), one-document samples with padded or packed
microbatch collation, and token-count files for the simulator. One implementation of each, used by the trainer,
the tools and the benchmarks."""
