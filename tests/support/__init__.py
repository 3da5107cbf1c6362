"""The project's own test harness: the fault matrix, the rank pools and the tiny Hugging Face clients.

Not part of the installed package (the wheel ships ``elastic_batches`` only): what users test
their own code with stays in :mod:`elastic_batches.testing`. Imported as ``support`` with
``tests/`` on ``sys.path``: pytest puts it there for the suite (and spawned ranks inherit the
parent's ``sys.path``), ``benchmarks/fault_matrix.py`` and ``benchmarks/hf_auto_batch.py`` insert
it, and the tests that launch ``tests/scripts/`` under ``torchrun`` or ``accelerate launch`` set
``PYTHONPATH``.

* :mod:`support.ranks`: :class:`~support.ranks.RankPool`, spawned gloo ranks that run test cases
  under a hard deadline.
* :mod:`support.fault_matrix`: the cells of the fault-injection matrix (``tests/test_fault_matrix.py``,
  ``docs/reliability.md``) and the churn measurements.
* :mod:`support.hf_models`: a word-level tokenizer, GPT-2 and BERT built from configs, without a download.
"""
