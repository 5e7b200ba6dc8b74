"""The manifest format: canonical bytes, seed compatibility, and refusal of every malformed input."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import integrity_fs as ifs
from integrity_fs import Manifest, ManifestError

D = hashlib.sha256(b"x").hexdigest()


def doc(**changes: object) -> bytes:
    base: dict[str, object] = {"version": 1, "granularity": "file", "algorithm": "sha256", "files": {"a": D}}
    base.update(changes)
    return json.dumps({k: v for k, v in base.items() if v is not ...}).encode()


def test_seed_example_parses_and_unknown_keys_are_ignored():
    raw = doc(files={"checkpoint_0.pt": D, ".metadata": D}, written_by="someone", extra={"x": 1})
    m = Manifest.from_json(raw)
    assert list(m.files) == [".metadata", "checkpoint_0.pt"] and m.sizes is None


def test_canonical_form_is_sorted_indented_utf8_with_newline():
    m = Manifest(files={"b": D, "ä/a": D}, sizes={"b": 1, "ä/a": 2})
    raw = m.to_json()
    assert raw.endswith(b"}\n") and "ä".encode() in raw
    assert raw == Manifest.from_json(raw).to_json()
    assert json.loads(raw) == {
        "algorithm": "sha256",
        "files": {"b": D, "ä/a": D},
        "granularity": "file",
        "sizes": {"b": 1, "ä/a": 2},
        "version": 1,
    }


def test_manifest_is_immutable():
    m = Manifest(files={"a": D})
    with pytest.raises(TypeError):
        m.files["a"] = D  # type: ignore[index]
    with pytest.raises(AttributeError):
        m.version = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[]", "must be a JSON object"),
        (b"null", "must be a JSON object"),
        (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
        (doc(version=...), "no 'version'"),
        (doc(files=...), "no 'files'"),
        (doc(algorithm=...), "no 'algorithm'"),
        (doc(granularity=...), "no 'granularity'"),
        (doc(version="1"), "version '1' is not supported"),
        (doc(version=True), "version True is not supported"),
        (doc(version=2), "version 2 is not supported"),
        (doc(algorithm=5), "'algorithm' must be a string"),
        (doc(files=[]), "'files' must be an object"),
        (doc(files={"a": 5}), "not a sha256 digest"),
        (doc(files={"a": D.upper()}), "not a sha256 digest"),
        (doc(files={"a": D[:-1]}), "not a sha256 digest"),
        (doc(files={"a": "g" * 64}), "not a sha256 digest"),
        (doc(sizes=[1]), "'sizes' must be an object"),
        (doc(sizes={"b": 1}), "exactly the files"),
        (doc(sizes={"a": -1}), "non-negative integer"),
        (doc(sizes={"a": 1.5}), "non-negative integer"),
        (doc(sizes={"a": "1"}), "non-negative integer"),
        (doc(chunk_size=4), "belong only to chunk granularity"),
        (doc(granularity="chunk", sizes={"a": 1}), "positive integer 'chunk_size'"),
        (doc(granularity="chunk", sizes={"a": 1}, chunk_size=4), "needs 'sizes', and 'chunks'"),
        (doc(granularity="chunk", sizes={"a": 1}, chunk_size=4, chunks={"a": "x"}), "lists of digests"),
        (doc(granularity="chunk", sizes={"a": 9}, chunk_size=4, chunks={"a": [D]}), "call for 3"),
        (doc(granularity="chunk", sizes={"a": 1}, chunk_size=4, chunks={"a": [D]}), "does not match its chunk"),
    ],
)
def test_malformed_manifest_says_what_is_wrong(raw, message):
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(raw)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "/etc/passwd",
        "../outside",
        "a/../../b",
        "a//b",
        "./a",
        "a/.",
        "a\\b",
        "C:/x",
        "a\x00b",
        "a/",
        "_integrity_manifest.json",
    ],
)
@pytest.mark.parametrize("among", [(), ("a", "b/c"), ("a",), ("z",)])
def test_names_that_escape_the_root_are_refused(name, among):
    files = dict.fromkeys([*among[:1], name, *among[1:]], D)  # alone, between, first or last
    with pytest.raises(ManifestError, match="file name|must not list itself"):
        Manifest.from_json(doc(files=files))


def test_nested_manifest_name_is_an_ordinary_file():
    assert Manifest.from_json(doc(files={f"sub/{ifs.MANIFEST_FILENAME}": D})).files


@pytest.mark.parametrize(("field", "value"), [("algorithm", "md5"), ("granularity", "tensor")])
def test_unknown_algorithm_or_granularity_is_not_implemented(field, value):
    with pytest.raises(NotImplementedError, match=value):
        Manifest.from_json(doc(**{field: value}))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"algorithm": "md5"}, NotImplementedError),
        ({"granularity": "tensor"}, NotImplementedError),
        ({"chunk_size": 1024}, ValueError),
        ({"granularity": "chunk", "chunk_size": 0}, ValueError),
        ({"granularity": "chunk", "chunk_size": 1.5}, TypeError),
        ({"granularity": "chunk", "chunk_size": True}, TypeError),
        ({"overwrite": "false"}, TypeError),
        ({"max_workers": 0}, ValueError),
    ],
)
def test_bad_seal_options_are_refused_before_anything_is_written(tmp_path, kwargs, error):
    (tmp_path / "a").write_bytes(b"a")
    with pytest.raises(error):
        ifs.seal(tmp_path, **kwargs)
    assert not (tmp_path / ifs.MANIFEST_FILENAME).exists()


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=5000),
    position=st.integers(min_value=0),
    bit=st.integers(min_value=0, max_value=7),
    granularity=st.sampled_from(["file", "chunk"]),
)
def test_any_single_flipped_bit_is_caught(tmp_path_factory, data, position, bit, granularity):
    root = tmp_path_factory.mktemp("flip")
    (root / "shard.bin").write_bytes(data)
    chunk_size = 512 if granularity == "chunk" else None
    ifs.seal(root, granularity=granularity, chunk_size=chunk_size)
    flipped = bytearray(data)
    flipped[position % len(data)] ^= 1 << bit
    (root / "shard.bin").write_bytes(bytes(flipped))
    with pytest.raises(ifs.IntegrityError) as err:
        ifs.verify(root)
    (problem,) = err.value.report.problems
    assert problem.path == "shard.bin" and problem.kind == "mismatch"
    if granularity == "chunk":
        start = (position % len(data)) // 512 * 512
        assert problem.byte_ranges == ((start, min(len(data), start + 512)),)


def test_manifest_pickles_as_itself():
    import pickle

    m = Manifest(files={"a": D}, sizes={"a": 1})
    assert pickle.loads(pickle.dumps(m)) == m


# --- strict parsing at C speed: a repeated key is refused however the document hides it ---------

_HEAD = '{"version": 1, "granularity": "file", "algorithm": "sha256", '
_REPEATS = {
    "files": _HEAD + f'"files": {{"a": "{D}", "a": "{"0" * 64}"}}}}',
    "top level": '{"version": 1, ' + _HEAD[1:] + '"files": {}}',
    "identical pair": _HEAD + f'"files": {{"a": "{D}", "a": "{D}"}}}}',
    "spaced colons": '{"version" : 1, "granularity" : "file", "algorithm" : "sha256", "files" : {}, "files" : {}}',
    "inside a list": _HEAD + '"files": {}, "x": [{"k": 1, "k": 2}]}',
    "deep in an unknown key": _HEAD + '"files": {}, "x": {"y": [[{"z": {"k": [], "k": {}}}]]}}',
    "a key with colons": _HEAD + '"files": {}, "x": {"a:b": 1, "a:b": 2}}',
    "the dropped value holds colons": _HEAD + '"files": {}, "x": {"k": "1:2:3", "k": "4"}}',
    # Each escaped colon parses to one more colon than the text shows: it must not make up for
    # the key the repeat dropped.
    "an escaped colon makes up for it": _HEAD + '"files": {}, "x": {"k": 1, "k": 2}, "y": "\\u003a"}',
    "an escaped key makes up for it": _HEAD + '"files": {}, "x": {"k": 1, "k": 2}, "\\u003a": 0}',
}


@pytest.mark.parametrize("text", _REPEATS.values(), ids=_REPEATS.keys())
@pytest.mark.parametrize("as_bytes", [True, False], ids=["bytes", "str"])
def test_a_repeated_key_is_refused_whatever_hides_it(text, as_bytes):
    assert json.loads(text)  # valid JSON, last one wins: what a lenient reader would take
    with pytest.raises(ManifestError, match="repeats the key"):
        Manifest.from_json(text.encode() if as_bytes else text)


def test_escapes_and_colons_in_names_parse_as_json_does():
    files = {"x/a:b": D, 'q"uote': D, "tab\tname": D, "é/ü:": D, "\u00e9": D, "\U0001f600": D}
    raw = json.dumps({"version": 1, "granularity": "file", "algorithm": "sha256", "files": files}).encode()
    assert b"\\u00e9" in raw  # ensure_ascii: the names come escaped
    assert dict(Manifest.from_json(raw).files) == files
    assert dict(Manifest.from_json(Manifest.from_json(raw).to_json()).files) == files


_KEYS = st.text(alphabet=st.sampled_from(["a", ":", '"', "\\", "é", "\n", " "]), max_size=4)
_DOCS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _KEYS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=25,
)


@settings(max_examples=200, deadline=None)
@given(value=_DOCS, ascii_only=st.booleans(), spaced=st.booleans(), repeat=st.booleans())
def test_a_manifest_holding_any_json_is_refused_exactly_when_it_repeats_a_key(value, ascii_only, spaced, repeat):
    """Any JSON value under an unknown key, written any way, with or without one key written
    twice: a manifest is refused exactly when its document repeats a key; otherwise the unknown
    key is ignored."""
    separators = (", ", " : ") if spaced else (",", ":")
    text = json.dumps({"doc": value}, ensure_ascii=ascii_only, separators=separators)
    if repeat:
        text = text[:-1] + separators[0] + text[1:]  # {"doc": v, "doc": v}
    text = _HEAD + '"files": {}, "x": ' + text + "}"
    for raw in (text, text.encode()):
        if repeat:
            with pytest.raises(ManifestError, match="repeats the key"):
                Manifest.from_json(raw)
        else:
            assert Manifest.from_json(raw).files == {}


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_json_constants_that_json_does_not_allow_are_refused(constant):
    with pytest.raises(ManifestError, match=constant.lstrip("-")):
        Manifest.from_json(_HEAD + '"files": {}, "x": ' + constant + "}")


def test_read_manifest_names_the_file_it_refused(tmp_path):
    (tmp_path / ifs.MANIFEST_FILENAME).write_text(_HEAD + f'"files": {{"a": "{D}", "a": "{D}"}}}}')
    with pytest.raises(ManifestError, match=ifs.MANIFEST_FILENAME):
        ifs.read_manifest(tmp_path)
    with pytest.raises(ManifestError):
        ifs.verify(tmp_path)
