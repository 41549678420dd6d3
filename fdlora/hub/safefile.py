"""Read a weight file without trusting it: safetensors checked before parsing, pickle only on request.

A safetensors file is 8 bytes of header length, a JSON header, then the tensor bytes. Before
handing it to `safetensors` we check that the header length is sane, the JSON parses, and every
tensor's byte range lies inside the file and matches its dtype and shape, so a truncated download
or a hostile header fails with a message that says which, instead of a bare parser error.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from math import prod

import torch

from ..errors import UnsafeFileError

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit; real LoRA headers are well under 1 MiB
READ_CHUNK = 16 << 20  # bytes per thread task when reading a large file
READ_THREADS = 8
PICKLE_EXTENSIONS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def is_pickle_name(name: str) -> bool:
    return name.lower().endswith(PICKLE_EXTENSIONS)


TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}


def read_weights(path: str, *, allow_pickle: bool = False,
                 pin: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors on CPU, safetensors `__metadata__` without its "format" entry) of the file at `path`.

    With `pin`, the whole file is read once into one buffer (page-locked when CUDA is available) and the
    tensors are views into it: no per-tensor copies, and the RAM cache keeps them as they are, ready for
    one device transfer.
    """
    if is_pickle_name(path):
        return _read_pickle(path, allow_pickle), {}
    header, start, entries = _check_header(path)
    if pin and all(e[3] in TORCH_DTYPES for e in entries):
        return _read_pinned(path, header, start, entries)
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError, TypeError) as e:
        raise UnsafeFileError(f"{path}: safetensors could not read it ({e}); download it again.") from None
    meta.pop("format", None)
    return tensors, meta


def read_into(path: str, buf: torch.Tensor) -> int:
    """Read the file at `path` into the uint8 tensor `buf`; returns the bytes read. Large files are read in
    chunks by several threads (`os.preadv` releases the GIL): one thread copies from the page cache at a
    fraction of the memory bandwidth, and first touches of fresh pages fault in parallel too."""
    size = buf.numel()
    view = memoryview(buf.numpy())
    workers = min(READ_THREADS, os.cpu_count() or 1, -(-size // READ_CHUNK))
    if workers < 2 or not hasattr(os, "preadv"):
        with open(path, "rb") as fh:
            return fh.readinto(view)
    fd = os.open(path, os.O_RDONLY)
    try:
        def chunk(offset: int) -> int:
            end = min(offset + READ_CHUNK, size)
            done = 0
            while offset + done < end:  # preadv may return less than asked (signals, huge reads)
                got = os.preadv(fd, [view[offset + done:end]], offset + done)
                if got == 0:
                    break
                done += got
            return done

        with ThreadPoolExecutor(workers, thread_name_prefix="fdlora-read") as pool:
            return sum(pool.map(chunk, range(0, size, READ_CHUNK)))
    finally:
        os.close(fd)


def _read_pinned(path: str, header: dict, start: int, entries: list[tuple]) -> tuple[dict[str, torch.Tensor],
                                                                                   dict[str, str]]:
    size = os.path.getsize(path)
    buf = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    if read_into(path, buf) != size:
        raise UnsafeFileError(f"{path}: the file changed size while being read; read it again.")
    typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer as each dtype: two ops per tensor instead of three
    tensors = {}
    for name, begin, stop, code, shape in sorted(entries):  # in name order, as the safetensors library gives them
        dtype = TORCH_DTYPES[code]
        begin, stop = begin + start, stop + start
        n = dtype.itemsize
        if begin % n:  # misaligned for its dtype: copy it out
            tensors[name] = buf[begin:stop].clone().view(dtype).view(shape)
            continue
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buf[:size - size % n].view(dtype)
        tensors[name] = whole[begin // n:stop // n].view(shape)
    meta = dict(header.get("__metadata__") or {})
    meta.pop("format", None)
    return tensors, meta


def _check_header(path: str) -> tuple[dict, int, list[tuple]]:
    """The parsed header, the byte offset where tensor data starts, and its tensors as (name, begin, stop, dtype
    code, shape) with offsets relative to that start, after checking all of them.

    These are the safetensors library's own rules (its `Metadata::validate` and the buffer-length check), so
    the one-buffer reader (`_read_pinned`, which never calls the library) accepts exactly the files the library
    does: the tensors tile the data section in offset order with no gap or overlap and end where the file ends;
    shapes are non-negative integers; a key appears once; `__metadata__` maps strings to strings. Nothing is
    allocated from what the header claims: sizes are Python integers compared with the file's real size.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise UnsafeFileError(f"{path}: {size} bytes is too short for a safetensors file; it is truncated "
                                  "or not safetensors. Download it again.")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES:
            raise UnsafeFileError(f"{path}: header claims {n} bytes (limit {MAX_HEADER_BYTES}); this is not a valid "
                                  "safetensors file. If it is a pickle checkpoint, rename it .bin/.ckpt and pass "
                                  "allow_pickle=True only if you trust its source.")
        if 8 + n > size:
            raise UnsafeFileError(f"{path}: header claims {n} bytes but the file has {size}; the file is truncated. "
                                  "Download it again (force_download=True).")
        raw = fh.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise UnsafeFileError(f"{path}: the safetensors header names {e.args[0]!r} twice; the file is corrupt or "
                              "crafted. Download it again.") from None
    except RecursionError:
        raise UnsafeFileError(f"{path}: the safetensors header nests too deeply; it is not a safetensors header.") \
            from None
    except (UnicodeDecodeError, ValueError):
        raise UnsafeFileError(f"{path}: the safetensors header is not valid JSON; the file is corrupt or not "
                              "safetensors. Download it again.") from None
    if not isinstance(header, dict):
        raise UnsafeFileError(f"{path}: the safetensors header is not a JSON object; the file is corrupt.")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise UnsafeFileError(f"{path}: the safetensors __metadata__ must map strings to strings, got "
                              f"{str(meta)[:80]}; the file is corrupt.")
    data = size - 8 - n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
                raise TypeError
            begin, stop = info["data_offsets"]
            shape, code = info["shape"], info["dtype"]
            if not all(type(x) is int and x >= 0 for x in (begin, stop, *shape)):
                raise ValueError
            nbytes = prod(shape) * DTYPE_BYTES[code]
        except (KeyError, TypeError, ValueError):
            raise UnsafeFileError(f"{path}: header entry {name!r} is malformed ({str(info)[:120]}); "
                                  "the file is corrupt.") from None
        if begin > stop or stop - begin != nbytes:
            raise UnsafeFileError(f"{path}: tensor {name!r} spans bytes {begin}..{stop} but its dtype and shape "
                                  f"need {nbytes}; the file is corrupt.")
        entries.append((name, begin, stop, code, list(shape)))
    end = 0
    for name, begin, stop, _, _ in sorted(entries, key=lambda e: (e[1], e[2])):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else "leaves a gap before it"
            raise UnsafeFileError(f"{path}: tensor {name!r} starts at data byte {begin}, which {what} (expected "
                                  f"{end}); the file is corrupt or crafted. Download it again.")
        end = stop
    if end > data:
        raise UnsafeFileError(f"{path}: tensors need {end} data bytes but the file has {data}; it is truncated. "
                              "Download it again (force_download=True).")
    if end < data:
        raise UnsafeFileError(f"{path}: {data - end} bytes follow the last tensor; the file is corrupt or not "
                              "what its header says. Download it again.")
    return header, 8 + n, entries


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def _read_pickle(path: str, allow_pickle: bool) -> dict[str, torch.Tensor]:
    if not allow_pickle:
        raise UnsafeFileError(
            f"{path} is a pickle checkpoint, and unpickling can run arbitrary code. Use a .safetensors file, or "
            "pass allow_pickle=True if you trust its source (it is then read with torch.load(weights_only=True))."
        )
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for bad pickles
        raise UnsafeFileError(f"{path}: torch.load(weights_only=True) refused it ({type(e).__name__}: {e}).") from None
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise UnsafeFileError(f"{path}: expected a dict of tensors, got {type(sd).__name__}.")
    return sd
