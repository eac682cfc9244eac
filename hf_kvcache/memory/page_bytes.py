"""A page's contents on the host (``PageData``) and as checked bytes (``encode_page``, ``decode_page``): how pages
leave a pool for its tiers and come back.

A page's contents are its slots in each of the pool's ``PoolStorage.tensors``, on the host:
``[num_layers, num_kv_heads, page_size, last_dim]`` each (per-channel key scales and zeros: ``[num_layers,
num_kv_heads, head_dim]``). Off the host a page travels as::

    magic | format digest (16) | chain key (16) | layer group (4) | tensors | blake2b checksum (16)
    tensor = dtype name | ndim | shape (int64 each) | byte count | raw bytes

and is served only if the checksum, the format digest (the whole ``PageFormat``), the key and every tensor's dtype
and shape are the ones asked for (else ``CorruptPage``).
"""

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvcache.memory.format import PageFormat
from hf_kvcache.memory.prefix_index import KEY_BYTES, PageKey, root_key

MAGIC = b"hfkvpg1\n"
TensorSpec = tuple[tuple[int, ...], torch.dtype]
"""A storage tensor's slots of one page: ``(shape, dtype)``."""


class CorruptPage(ValueError):
    """Bytes that are not the page asked for (``decode_page``)."""


@dataclass
class PageData:
    """One page's contents on the host, a tensor per ``PoolStorage.tensors``; ``ready``: an event recorded after the
    copies from a CUDA pool (pinned, not waited for), ``None`` once done."""

    tensors: tuple[torch.Tensor, ...]
    ready: Any = None

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors)

    def wait(self) -> "PageData":
        """Waits for the copies from the device (if any) and returns itself."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self


def format_digest(page_format: PageFormat) -> bytes:
    """What a page's bytes mean: the whole page format (geometry, dtype, page size, codes), hashed."""
    return root_key("hf_kvcache page", 1, repr(page_format))


def store_key(digest: bytes, key: PageKey) -> bytes:
    """A page's name in the store and the directory: a hash of its format digest, chain key and layer group."""
    chain, layer_group = key
    name = hashlib.blake2b(digest + chain + layer_group.to_bytes(4, "little"), digest_size=KEY_BYTES).hexdigest()
    return f"hf_kvcache:page:{name}".encode()


def encode_page(digest: bytes, key: PageKey, data: PageData) -> bytes:
    """A page's bytes (the module docstring's layout)."""
    parts = [MAGIC, digest, key[0], key[1].to_bytes(4, "little"), len(data.tensors).to_bytes(4, "little")]
    for tensor in data.wait().tensors:
        name = str(tensor.dtype).removeprefix("torch.").encode()
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        parts += [bytes([len(name)]), name, bytes([tensor.ndim]), struct.pack(f"<{tensor.ndim}q", *tensor.shape)]
        parts += [struct.pack("<Q", len(raw)), raw]
    body = b"".join(parts)
    return body + hashlib.blake2b(body, digest_size=KEY_BYTES).digest()


def decode_page(blob: bytes, digest: bytes, key: PageKey, specs: list[TensorSpec] | None) -> PageData:
    """The page ``key`` from its bytes, whose tensors must be ``specs`` (``None``: any, as a tail's); raises
    ``CorruptPage`` for bytes damaged, of another page or of another page format."""
    size = KEY_BYTES
    if len(blob) < len(MAGIC) + 2 * size + 8 + size:
        raise CorruptPage(f"{len(blob)} bytes are too few for a page")
    body, checksum = memoryview(blob)[:-size], blob[-size:]
    if hashlib.blake2b(body, digest_size=size).digest() != checksum:
        raise CorruptPage("the checksum does not match")
    if bytes(body[: len(MAGIC)]) != MAGIC:
        raise CorruptPage("not a page of hf_kvcache")
    at = len(MAGIC)
    if bytes(body[at : at + size]) != digest:
        raise CorruptPage("a page of another page format")
    at += size
    if bytes(body[at : at + size]) != key[0] or int.from_bytes(body[at + size : at + size + 4], "little") != key[1]:
        raise CorruptPage("a page of other tokens, model or layer group")
    at += size + 4
    count = int.from_bytes(body[at : at + 4], "little")
    at += 4
    if specs is not None and count != len(specs):
        raise CorruptPage(f"{count} tensors where the pool has {len(specs)}")
    buffer = bytearray(body)  # one copy, writable: the tensors are views of it
    tensors = []
    try:
        for index in range(count):
            name_len = buffer[at]
            name = buffer[at + 1 : at + 1 + name_len].decode()
            at += 1 + name_len
            ndim = buffer[at]
            found = struct.unpack_from(f"<{ndim}q", buffer, at + 1)
            at += 1 + 8 * ndim
            (num_bytes,) = struct.unpack_from("<Q", buffer, at)
            at += 8
            shape, dtype = specs[index] if specs is not None else (tuple(found), getattr(torch, name, None))
            if name != str(dtype).removeprefix("torch.") or tuple(found) != tuple(shape) or at + num_bytes > len(body):
                raise CorruptPage(f"a tensor of {name} {tuple(found)} where the pool has {dtype} {tuple(shape)}")
            raw = torch.frombuffer(buffer, dtype=torch.uint8, count=num_bytes, offset=at) if num_bytes else None
            tensor = torch.empty(shape, dtype=dtype) if raw is None else raw.view(dtype).reshape(shape)
            tensors.append(tensor)
            at += num_bytes
    except (IndexError, struct.error, UnicodeDecodeError, RuntimeError) as error:
        raise CorruptPage(f"unreadable ({error})") from error
    if at != len(body):
        raise CorruptPage("trailing bytes")
    return PageData(tuple(tensors))
