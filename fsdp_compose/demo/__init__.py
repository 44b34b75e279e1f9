"""The ``make demo`` training run: a small Llama-style model learning to spell
from the text shipped in ``data.txt``, sharded with ``fully_shard``.
See ``train.run`` (or ``fsdp-compose demo --help``)."""
