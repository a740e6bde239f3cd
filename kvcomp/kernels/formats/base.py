"""The payload-format contract: what a reader says about one encoded segment, for the torch reference and for the
fused decode kernel.

A decode step's keys and values are each a list of *segments* in cache order: full-precision tensors
``[B, H, T, D]`` and payload readers. A reader decodes its segment in torch (:meth:`PayloadReader.dequantize`) and
tells the split kernel how to read it in registers:

- its device functions (:class:`KernelFormat`) in the format's ``*_triton`` module, which imports the reader and is
  found by the reader's class (:data:`~kvcomp.kernels.formats.kernels_triton.KERNEL_FORMATS`; Triton is optional);
- :meth:`PayloadReader.kernel_args`: its runtime arguments (one named tuple: only the tensors and strides the format
  reads) and compile-time constants (another);
- :meth:`~PayloadReader.tile_limit`, :attr:`~PayloadReader.wide_tile` and :attr:`~PayloadReader.chunk_tokens`: its
  tile sizes and where its tiles may start;
- :meth:`~PayloadReader.register_cap` and :meth:`~PayloadReader.crowded_warps`: its registers per thread and warps
  per program where a launch's grid crowds the multiprocessors;
- :meth:`~PayloadReader.packed_scores`, :meth:`~PayloadReader.packed_values` and :attr:`~PayloadReader.sign_scores`:
  whether it is read in its stored layout, and whether its keys are scored from sign bits (values then stay off the
  field-major path above 4 query rows);
- :attr:`~PayloadReader.values_only`: whether it is refused as keys (sign bits, read as values or as a key residual);
- :attr:`~PayloadReader.own_launches` and :meth:`~PayloadReader.unwrap`: a reader that wraps another
  (:mod:`~kvcomp.kernels.formats.wrappers`: rotated, offset, residual sketch) is read in launch groups of its own,
  and says what it adds to them (:class:`Wrapped`).

The launcher (:mod:`kvcomp.kernels.decode_attention_triton`) asks a payload reader these, and finds its device
functions by the reader's class (a key residual's too:
:func:`~kvcomp.kernels.formats.kernels_triton.residual_format`). It tests a segment's type only to tell
full-precision tensors from payloads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvcomp.stages.rope import apply_rope


@dataclass
class RotaryPositions:
    """RoPE of the tokens of one key payload, recomputed from positions as the model's rotary embedding
    does: ``cos = cos(pos * inv_freq) * scaling`` rounded to the model's ``dtype`` (HF's cos/sin dtype).

    ``positions [B, L]``: the position id of every cached token; the payload's token ``t`` is cached
    token ``first + t``.
    """

    positions: torch.Tensor
    first: int
    inv_freq: torch.Tensor  # [D/2] float32
    scaling: float
    dtype: torch.dtype

    def cos_sin(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B, T, D]`` (float32) of the payload's ``num_tokens`` tokens."""
        pos = self.positions[:, self.first : self.first + num_tokens].float()
        freqs = pos[..., None] * self.inv_freq.float().to(pos.device)
        angles = torch.cat([freqs, freqs], dim=-1)
        return tuple((f(angles) * self.scaling).to(self.dtype).float() for f in (torch.cos, torch.sin))


class KernelFormat(NamedTuple):
    """A format's Triton device functions, passed to the split kernel as one compile-time argument (the kernel is
    compiled per (key format, value format)). Each takes the format's runtime arguments ``a`` and constants ``C``
    (:meth:`PayloadReader.kernel_args`):

    - ``advance(a, C, b, h, D)``: ``a`` with every tensor advanced to sequence ``b`` and KV head ``h`` (int64);
    - ``halves(a, C, length, t, t0, t_ok, c, c_ok, D, BLOCK_T)``: payload tokens ``t`` (the first ``t0``, valid
      ``t_ok``) x channel halves ``c`` and ``c + D/2`` as two float32 tiles (``None``: the format is only scored);
    - ``scores(query, q_ptr, R, rows, row_ok, qk_scale, a, C, length, t, t0, t_ok, D, BLOCK_R, BLOCK_T, DOT)``: logits
      of keys read in their stored layout (``None``: keys are decoded by ``halves`` and scored), ``query`` what
      ``query`` prepared;
    - ``fields(p, rows, a, C, t, t_ok, D, BLOCK_R, BLOCK_T, DOT, OPERAND)``: ``P V`` of values in their stored layout
      (``tl.dot`` on ``OPERAND`` operands, or in registers), field-major
      ``[BLOCK_R, 8 / C.BITS, D * C.BITS / 8]`` (``None``: values are decoded by ``halves``);
    - ``query(q_ptr, rows, row_ok, qk_scale, a, C, D, DOT, OPERAND)``: what ``scores`` reads of the query (``tl.dot``
      operands in ``OPERAND``, the launch's ``operands``), prepared once per
      program before the tile loop (with ``scores``)."""

    name: str
    advance: object
    halves: object = None
    scores: object = None
    fields: object = None
    query: object = None

    def __repr__(self) -> str:
        """The name and each function's source hash: Triton keys its on-disk kernel cache on this text for a
        compile-time argument (not on the functions' sources), so an edited format function recompiles."""
        keys = [getattr(f, "cache_key", f) for f in self[1:]]  # (Triton's in-memory key passes the hashes themselves)
        return f"KernelFormat({self.name!r}, {keys})"

    @property
    def cache_key(self) -> str:
        return repr(self)


def in_place(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], int, int]:
    """Tensors ``[B, H, ...]`` (or ``[B, T]``) of one shape as a kernel reads them, and their shared sequence
    and head strides (0 for ``[B, T]``): read in place when each (sequence, head) slice is contiguous and
    the strides agree (a payload store's views, narrowed along tokens from buffers with spare capacity),
    else copied contiguous. The copy would read and write the whole payload at every layer and step."""
    inner = (lambda t: t[0, 0]) if tensors[0].dim() > 2 else (lambda t: t[0])
    strides = {t.stride()[:2] for t in tensors}
    if len(strides) > 1 or not all(inner(t).is_contiguous() for t in tensors):
        tensors = tuple(t.contiguous() for t in tensors)
    first = tensors[0]
    return list(tensors), first.stride(0), first.stride(1) if first.dim() > 2 else 0


class Strided(NamedTuple):
    """One tensor as a kernel reads it in place (:func:`in_place`): where sequence 0 and head 0 start, and the
    sequence and head strides."""

    ptr: torch.Tensor
    s_b: int
    s_h: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Strided:
        (tensor,), s_b, s_h = in_place(tensor)
        return cls(tensor, s_b, s_h)


class CallQuery:
    """One call's query as the kernels read it (``q``: ``[B, H, R, D]``) and the tensors formats derive from it (QJL's
    ``y = S q``): each made once per call (:meth:`derived`) and shared by the call's launches. A call captured in a CUDA
    graph remakes them in place from the graph's own copy of the query at every replay (:meth:`refresh`;
    :mod:`kvcomp.kernels.decode_graphs`), so that a replay with another query reads what that query derives."""

    def __init__(self, q: torch.Tensor):
        self.q = q
        self._made = {}  # key -> (make, its tensors)

    def derived(self, key, make) -> tuple[torch.Tensor, ...]:
        """``make(q)``, a tuple of tensors, made the first time this call asks for ``key``."""
        if key not in self._made:
            self._made[key] = (make, tuple(make(self.q)))
        return self._made[key][1]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor derived so far."""
        return [tensor for _, made in self._made.values() for tensor in made]

    def refresh(self, q: torch.Tensor) -> None:
        """Every derived tensor remade from ``q`` into its own storage."""
        for make, made in self._made.values():
            for tensor, new in zip(made, make(q)):
                tensor.copy_(new)


def unrotated(q: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """The model's query, float32, from a call's query ``q`` ``[B, H, R, D]`` rotated with its payload by ``rotation^T``
    (``[D, D]`` or one per KV head; ``None``: ``q`` itself, copied): ``q rotation``, the rotation being orthogonal."""
    return q.float() @ rotation.float() if rotation is not None else q.to(torch.float32, copy=True)


def four_programs(num_warps: int) -> int:
    """Registers per thread at which four programs of ``num_warps`` warps share a multiprocessor's 65,536."""
    return 65536 // (4 * 32 * num_warps)


class Wrapped:
    """What the readers wrapping a stored payload add to the launches of one stream (:meth:`PayloadReader.unwrap`,
    outermost first), which read the payload as it is stored, ``x = stored @ rotation + sketch + offset``:

    - ``rotation``: stored in a rotated basis (``[D, D]`` or ``[1 or H, D, D]``): keys are scored against the query
      rotated by ``rotation^T``, values' partial outputs are un-rotated (``@ rotation``);
    - ``offset``: stored less ``c`` ``[H, D]``, rotated to each token's position where ``offset_rotated`` (keys): the
      kernel adds a key offset's score ``q . R_p c``, and a value offset's ``c`` is added to the partial outputs;
    - ``sketch``: plus the sign sketch of the residual, an object with ``residual`` (a reader with ``residual_args``:
      scored beside the keys in the kernel; values: read in launches of their own over the same keys),
      ``projection`` (``S``) and ``basis`` (what takes the sketch's partial outputs back to the vectors' basis).

    Each term is set at most once, and only outside the terms after it in :attr:`NESTING` (an offset wraps a sketch,
    which wraps a rotation)."""

    NESTING = ("offset", "sketch", "rotation")  # outermost first

    def __init__(self):
        self.rotation = None
        self.offset = None
        self.offset_rotated = False
        self.sketch = None

    def add(self, term: str, **fields) -> None:
        """Set ``term``'s ``fields``: refused where ``term`` or one it must wrap is set (by a wrapper outside this
        one, unwrapped before it)."""
        if any(getattr(self, name) is not None for name in self.NESTING[self.NESTING.index(term):]):
            raise ValueError(f"decode kernel: a payload's wrappers nest as {'('.join(self.NESTING)}(payload"
                             f"{')' * len(self.NESTING)}, each at most once")
        for name, value in fields.items():
            setattr(self, name, value)


@dataclass
class PayloadReader:
    """What a kernel needs to read one encoded segment; subclasses define the format."""

    num_tokens: int
    head_dim: int
    wide_tile = False  # whether the kernel's wide tiles suit it (read without a per-group table: default_tile)
    chunk_tokens = 1  # tokens the kernel reads as one unit: a tile of the payload starts at a multiple of them
    sign_scores = False  # keys scored from sign bits, a [tokens, sketch rows] tile in registers (QJL's sketch)
    values_only = False  # refused as keys (sign bits: read as values, or as a key payload's residual)
    own_launches = False  # wraps another reader (unwrap): read in launch groups of its own

    def unwrap(self, wrapped: Wrapped) -> PayloadReader:
        """The reader this one wraps, having added to ``wrapped`` what it adds to the launches (:class:`Wrapped`); a
        reader of what is stored, itself (the default; wrappers set :attr:`own_launches`)."""
        return self

    def dequantize_unrotated(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def kv_heads(self) -> int:
        return self.codes.shape[1]

    def kernel_args(self, query: CallQuery) -> tuple[NamedTuple, NamedTuple]:
        """The split kernel's arguments for this payload: runtime (its tensors and strides) and compile-time (its
        format constants), each a named tuple of this format's. ``query``: the call's query and what formats derive
        from it, shared by the call's launches."""
        raise NotImplementedError(f"the fused decode kernel cannot read a {type(self).__name__} payload")

    def tile_limit(self, block_tokens: int, dot: bool) -> int:
        """Tokens per tile this payload allows, at most ``block_tokens`` (``dot``: a ``tl.dot`` launch)."""
        return block_tokens

    def register_cap(self, narrow: bool, num_warps: int) -> int:
        """Registers per thread that a ``tl.dot`` launch of ``num_warps`` warps reading this payload is capped at, so
        that more programs share a multiprocessor (0: the compiler's choice; :func:`four_programs`); ``narrow``: its
        tiles are at most the launcher's narrow tile (``decode_attention_triton.TILE`` tokens)."""
        return 0

    def crowded_warps(self, narrow: bool) -> int:
        """Warps per program that a ``tl.dot`` launch reading this payload takes where its grid fills the busiest
        multiprocessor with sixteen warps or more of them (0: the launcher's default, ``decode_attention_triton.WARPS``);
        ``narrow``: as in :meth:`register_cap`."""
        return 0

    def packed_scores(self, head_dim: int, dot: bool) -> bool:
        """Whether keys of this format are scored in their stored layout (:attr:`KernelFormat.scores`)."""
        return False

    def packed_values(self, head_dim: int, dot: bool) -> bool:
        """Whether values of this format are weighted in their stored layout (:attr:`KernelFormat.fields`)."""
        return False

    def torch_scores(self, q: torch.Tensor) -> torch.Tensor:
        """``q [B, H, R, D]`` (float32) against this payload's (post-RoPE) keys in torch, ``[B, H, R, T]`` (the torch
        path's tiles, :mod:`kvcomp.cache.tiles`): decoded, then multiplied; a format may fold its
        parameters into the query instead."""
        return q @ self.dequantize().transpose(-1, -2)

    def torch_values(self, weights: torch.Tensor) -> torch.Tensor:
        """``sum_t weights[..., t] v_t`` over this payload's values in torch, ``[B, H, R, T]`` -> ``[B, H, R, D]``
        float32 (as :meth:`torch_scores`)."""
        return weights @ self.dequantize()

    def dequantize(self, rope: RotaryPositions | None = None) -> torch.Tensor:
        """The segment decoded in torch, ``[B, H, T, D]`` float32 (rotated when ``rope`` is given)."""
        x = self.dequantize_unrotated()
        if rope is None:
            return x
        return apply_rope(x, *rope.cos_sin(self.num_tokens))


Segment = torch.Tensor | PayloadReader


def stored(segment: Segment) -> tuple[Segment, Wrapped]:
    """The segment as it is stored, its wrappers unwrapped (:meth:`PayloadReader.unwrap`), and what they add to its
    launches."""
    wrapped = Wrapped()
    if isinstance(segment, torch.Tensor):
        return segment, wrapped
    while True:
        inner = segment.unwrap(wrapped)
        if inner is segment:
            return segment, wrapped
        segment = inner


def segment_length(segment: Segment) -> int:
    return segment.num_tokens if isinstance(segment, PayloadReader) else segment.shape[2]
