"""``seal`` and ``verify`` as collectives over ``torch.distributed``: every rank reaches the same verdict.

Two modes:

- ``"sharded"`` (default): rank 0 reads the manifest and lists the checkpoint, every rank hashes its
  share of the units (files, or chunks of files), the digests are gathered, and every rank computes
  the same report. Time falls with world size until storage bandwidth is the limit.
- ``"rank0"``: rank 0 does all the I/O with the local function; the verdict is broadcast (the seed's
  design).

Every rank returns an equal result or raises the same exception type with the same message,
whichever rank hit the problem: each local step is wrapped so that its exception becomes data (a
:class:`Failure`), every rank runs the same sequence of collectives whatever happened, and the
verdict is raised only after the last collective. The first collective agrees on the mode (and, in
sharded mode, checks that every rank sees the same files), so a bad argument on one rank cannot
leave the others waiting; a ``KeyboardInterrupt`` (any ``BaseException``) in a step is carried
like a failure and re-raised on its own rank after the collectives. Without an initialised process
group both functions are the local ones. torch is imported only when a function here is called.

What is checked or written travels as one object, rank 0's: ``options=`` takes a
:class:`~integrity_fs.VerifyOptions` (a :class:`~integrity_fs.SealOptions` for :func:`seal`), or
the keywords that make one, as the local functions take them.

With NCCL, object collectives travel through the current CUDA device: call
``torch.cuda.set_device(local_rank)`` before calling these functions, as for any NCCL collective.
"""

from ..collectives import INSTALL_HINT, MODES, Failure, Mode
from .checkpoints import agreed_candidates, latest_verified, prune, status
from .pipelines import seal, shard_units, verify

__all__ = [
    "INSTALL_HINT",
    "MODES",
    "Failure",
    "Mode",
    "agreed_candidates",
    "latest_verified",
    "prune",
    "seal",
    "shard_units",
    "status",
    "verify",
]
