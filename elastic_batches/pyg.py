"""PyTorch Geometric: a ``Batch`` of graphs split by graph.

:func:`register_pyg_batch` registers ``torch_geometric.data.Batch`` (and so the ``DataBatch``
and ``HeteroDataBatch`` classes PyG makes from it at run time) with
:func:`elastic_batches.register_batch_type`: a batch is taken apart into its graphs (one
per-sample field of ``Data`` objects, split with the rows) and each microbatch is collated again
with ``Batch.from_data_list``, keeping the attributes the loader's ``follow_batch`` added.
A microbatch of ``k`` graphs is then the batch PyG's ``DataLoader`` would have made of them.
"""

from __future__ import annotations

from typing import Any

from elastic_batches.structures import register_batch_type

__all__ = ["register_pyg_batch"]

_GRAPHS = "graphs"
_FOLLOW_BATCH = "follow_batch"


def _graphs_of(batch: Any) -> dict[str, Any]:
    """A PyG ``Batch`` as its graphs and the attributes ``follow_batch`` gave a batch vector."""
    keys = set(batch.keys())
    sliced = getattr(batch, "_slice_dict", None) or {}  # to_data_list says it when a batch has none
    follow = tuple(key for key in sliced if f"{key}_batch" in keys)
    return {_GRAPHS: batch.to_data_list(), _FOLLOW_BATCH: follow}


def _batch_of(fields: dict[str, Any]) -> Any:
    """The ``Batch`` of a microbatch's graphs, as PyG's collate makes it."""
    from torch_geometric.data import Batch

    follow = list(fields[_FOLLOW_BATCH]) or None
    return Batch.from_data_list(fields[_GRAPHS], follow_batch=follow)


def register_pyg_batch() -> None:
    """Teach elastic_batches to split PyTorch Geometric batches by graph.

    Registers ``torch_geometric.data.Batch``: a batch from PyG's ``DataLoader`` (whose class,
    ``DataBatch``, PyG makes at run time from ``Batch``) has one row per graph; a microbatch is
    ``Batch.from_data_list`` of its graphs, with the loader's ``follow_batch`` attributes. A
    loss that is a mean over graphs needs nothing more; for a mean over nodes, pass
    ``count_fn=lambda batch: batch.num_nodes`` to :meth:`ElasticStep.backward`. Call it once, at
    import time (the registration reaches DataLoader workers, ``spawn`` included). Calling it
    again changes nothing.

    Raises:
        ImportError: torch_geometric is not installed.

    Example:
        >>> import torch
        >>> from torch_geometric.data import Batch, Data
        >>> import elastic_batches as eb
        >>> eb.register_pyg_batch()
        >>> graphs = [Data(x=torch.randn(n, 4), edge_index=torch.tensor([[0, 1], [1, 0]])) for n in (2, 3, 4)]
        >>> batch = eb.ElasticBatch.wrap(Batch.from_data_list(graphs))
        >>> [(mb.unwrap().num_graphs, mb.unwrap().num_nodes) for mb in batch.microbatches(2)]
        [(2, 5), (1, 4)]
    """
    try:
        from torch_geometric.data import Batch
    except ImportError as err:
        raise ImportError(
            "elastic_batches.register_pyg_batch needs torch_geometric: pip install torch-geometric"
        ) from err
    register_batch_type(Batch, to_tensordict=_graphs_of, from_tensordict=_batch_of)
