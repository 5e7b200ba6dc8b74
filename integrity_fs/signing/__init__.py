"""Signatures over a manifest's digests, in the format OpenSSF model_signing writes with a key.

``model.sig`` is a Sigstore bundle (media type v0.3) holding a DSSE envelope over an in-toto v1
statement whose predicate (``https://model_signing/signature/v1.0``) lists every signed resource
with its digest; the subject names the checkpoint, and its digest is the SHA-256 of the
resources' raw digests, in order. File granularity is model_signing's ``files`` serialization
(one resource per file, its SHA-256: our file digest). Chunk granularity is its ``shards``
serialization with ``shard_size = chunk_size`` (one resource ``name:start:end`` per chunk: our
chunk digests); empty files have no shard there, so the statement names them in a predicate
field of ours that model_signing ignores (see :mod:`.statement`). Under model_signing's own shard
statements an empty file passes while it is empty (see :func:`covers_empty_files`).

Pure: bytes in, bytes out. Reading and writing ``model.sig`` is ``integrity_fs.manifests``' job. The signature
itself is ECDSA through ``cryptography`` (extra ``sign``), imported when a key is used.
"""

from ..report import SIGNATURE_FILENAME
from .bundle import BUNDLE_MEDIA_TYPE, PAYLOAD_TYPE, open_bundle, pae, pae_compat, read_envelope, sign
from .compare import (
    check_model_name,
    covers_empty_files,
    describe_differences,
    differences,
    to_manifest,
    with_empty_files,
)
from .keys import INSTALL_HINT, PrivateKey, PublicKey, load_private_key, load_public_key
from .statement import (
    EXTENSION,
    IGNORE_PATHS,
    PREDICATE_TYPE,
    PREDICATE_TYPE_COMPAT,
    STATEMENT_TYPE,
    Signed,
    check_shard_names,
    check_signable,
    read_statement,
    resources,
    signed_manifest,
    statement,
)

__all__ = [
    "BUNDLE_MEDIA_TYPE",
    "EXTENSION",
    "IGNORE_PATHS",
    "INSTALL_HINT",
    "PAYLOAD_TYPE",
    "PREDICATE_TYPE",
    "PREDICATE_TYPE_COMPAT",
    "SIGNATURE_FILENAME",
    "STATEMENT_TYPE",
    "PrivateKey",
    "PublicKey",
    "Signed",
    "check_model_name",
    "check_shard_names",
    "check_signable",
    "covers_empty_files",
    "describe_differences",
    "differences",
    "load_private_key",
    "load_public_key",
    "open_bundle",
    "pae",
    "pae_compat",
    "read_envelope",
    "read_statement",
    "resources",
    "sign",
    "signed_manifest",
    "statement",
    "to_manifest",
    "with_empty_files",
]
