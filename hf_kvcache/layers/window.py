"""Windows over pages (``WindowRows``): each row's last ``window`` tokens and first ``sink_tokens`` real ones, in
pages in token order (page ``i`` holds tokens ``[i * page_size, (i + 1) * page_size)``).

A row keeps its last ``reach = window - 1 + page_size`` tokens: what the next step sees and a page more, so that a
crop of up to ``page_size`` tokens stays exact and a repeated prompt's pages serve up to its last page. Pages behind
that go back to the pool, but its sinks' (their entries become holes, the null page): a row holds
``window_pages_per_row`` pages at most (a chunk of a chunked prefill past the window also holds, until the next step,
the pages of the ``window - 1`` tokens before it).

Attention gets the visible tokens in time order (``visible_span``), as transformers' sliding layer returns them, so
its mask, padding and chunked prefill apply unchanged. Once the window has left the sinks behind, the mask's
``sink_tokens`` columns before the window hold each row's sinks, tokens ``[pad, pad + sink_tokens)``, or where a
padded row's window still reaches them its tokens just before the window: a real, earlier token under a real, earlier
column, so every attention masks a padded row as the row alone. Under our attention a step of several tokens also
gets its ``band``: on a full-attention layer it makes prefill see exactly what decoding does.
"""

from collections.abc import Callable
from typing import Any

import torch

from hf_kvcache.attention.reads import KeyLayout
from hf_kvcache.layers.plan import StepPlan
from hf_kvcache.layers.rows import PagedRows
from hf_kvcache.memory.allocator import NULL_PAGE
from hf_kvcache.memory.page_pool import PagePool


def band(
    tokens: torch.Tensor,
    start: int,
    num_new: int,
    window: int,
    sink_tokens: int,
    pad_lengths: torch.Tensor,
    step_sees_itself: bool = False,
) -> torch.Tensor:
    """``[batch, num_new, n]``: may new token ``start + i`` of row ``b`` see token ``tokens[b, j]``?

    A row sees its window and its own sinks (its first ``sink_tokens`` real tokens), never padding; ``-1`` in
    ``tokens`` marks a key that holds no token. A padding query is left to the model's mask.

    Args:
        tokens: ``[batch, n]`` the token each key holds.
        pad_lengths: ``[batch]`` leading padding tokens of each row.
        step_sees_itself: each new token sees the step's earlier tokens and the ``window - 1`` before the step, as
            transformers' sliding layer returns them (the model's own mask applies its window among them).
    """
    query = torch.arange(start, start + num_new, device=tokens.device).view(1, -1, 1)  # [1, num_new, 1]
    keys = tokens.unsqueeze(1)  # [batch, 1, n]
    pads = pad_lengths.view(-1, 1, 1)  # [batch, 1, 1]
    reach = start if step_sees_itself else query  # the token whose window bounds what a new token sees
    seen = (keys <= query) & ((keys > reach - window) | (keys - pads < sink_tokens))
    return (seen & (keys >= pads)) | (query < pads)


def visible_span(start: int, num_new: int, window: int, sink_tokens: int) -> tuple[int, int]:
    """``(num_sinks, first)``: attention sees tokens ``[0, num_sinks)`` and ``[first, start + num_new)``."""
    first = max(0, start - window + 1)
    if first <= sink_tokens:  # the window reaches back to the sinks: one contiguous span
        return 0, 0
    return sink_tokens, first


def window_pages_per_row(window: int, sink_tokens: int, page_size: int) -> int:
    """The most pages a row of a window holds after a prefill from token 0 or a step of at most ``page_size`` tokens:
    the pages its sinks and its last ``window - 1 + page_size`` tokens may touch (``WindowRows``)."""
    touched = lambda tokens: -(-(tokens - 1) // page_size) + 1 if tokens else 0  # noqa: E731  (pages they may touch)
    return touched(sink_tokens) + touched(window - 1 + page_size)


class WindowRows(PagedRows):
    """The rows of one layer group of window layers.

    Args:
        pool: where the pages live.
        window: tokens each query attends to, itself included (transformers' ``sliding_window``).
        sink_tokens: first real tokens of a row kept for good (attention sinks).
        residual_length / our_attention / process_group: as for ``PagedRows``.
        is_sliding: the model's own mask applies the window (``band``'s ``step_sees_itself``); ``False`` where the
            cache imposes it on a full-attention layer.
    """

    defers_codes = False  # a window's oldest pages leave: each token's value codes are written with it

    def __init__(
        self,
        pool: PagePool,
        window: int,
        sink_tokens: int = 0,
        residual_length: int = 0,
        our_attention: Callable[[], bool] = lambda: False,
        process_group: Any = None,
        is_sliding: bool = False,
    ) -> None:
        super().__init__(pool, residual_length, True, our_attention, process_group=process_group)
        if self.store.keys is not None and sink_tokens:
            raise ValueError(
                f"sink_tokens={sink_tokens}: a window with encoded keys keeps no sinks (its keys are read from its "
                "first visible page on); use a pool without key_bits, or sink_tokens=0."
            )
        self.window, self.sink_tokens, self.is_sliding = window, sink_tokens, is_sliding
        self.reach = window - 1 + pool.format.page_size  # tokens a row keeps behind its end (besides its sinks)
        self.path.window = (window, sink_tokens)

    # ----- pages -----------------------------------------------------------------------------

    def _grow(self, batch: int, start: int, num_new: int, identical_rows: list[int] | None) -> None:
        """Gives back the pages behind both what the step sees and its last ``reach`` tokens, then takes the step's:
        none for its tokens behind its last ``reach`` (a step longer than that keeps only its tail)."""
        end, page_size = start + num_new, self.pool.format.page_size
        sink_ends = [pad + self.sink_tokens for pad in self._pad_list(batch)]

        def sink(row: int, page: int) -> bool:
            return self.sink_tokens > 0 and page * page_size < sink_ends[row]

        low = min(start - self.window + 1, end - self.reach)  # the first token the step or a crop after it reads
        if low >= page_size and self.table.num_rows:
            self._apply(
                lambda: self.table.drop(lambda row, page: (page + 1) * page_size <= low and not sink(row, page))
            )
        keeps = lambda row, page: sink(row, page) or (page + 1) * page_size > end - self.reach  # noqa: E731
        self._apply(lambda: self.table.grow(batch, num_new, identical_rows, keeps))

    def check_crop(self, num_tokens: int) -> None:
        """Raises ``ValueError`` if cropping to ``num_tokens`` needs tokens whose pages were given back."""
        needed = max(0, num_tokens - self.window + 1)  # the first token the step after the crop sees
        page_size = self.pool.format.page_size
        for row, skip in zip(self.table.rows, self.table.row_skips):
            for page in range(needed // page_size, -(-num_tokens // page_size)):
                if page >= skip and row[page - skip] == NULL_PAGE:
                    raise ValueError(
                        f"Cannot crop to {num_tokens} tokens: the window of {self.window} gave back the page of "
                        f"token {page * page_size}, and token {needed} would be needed. Crop at most {page_size} "
                        "tokens per step."
                    )

    def crop(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"Cannot crop to {num_tokens} tokens: the cache holds {self.num_tokens}.")
        self.check_crop(num_tokens)
        super().crop(num_tokens)

    # ----- an eager step's plan ------------------------------------------------------------------

    def _span(self, start: int, num_new: int) -> tuple[int, int]:
        return visible_span(start, num_new, self.window, self.sink_tokens)

    def _reads(
        self, start: int, num_new: int, capacity_pages: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
        """A window reads its visible tokens (``_visible``): an eager step whole pages from the first visible token's
        (an index page_size times smaller), or with sinks, which differ per row, slot by slot; given a capacity (its
        count is the window's), ``sink_tokens + window`` keys slot by slot whatever the step, so that one graph serves
        the window as it fills and slides (keys past the step's tokens read the null page, which the causal mask
        hides)."""
        sinks, first = visible_span(start, num_new, self.window, self.sink_tokens)
        end, page_size = start + num_new, self.pool.format.page_size
        if capacity_pages is not None and not first:  # the window still reaches the sinks: tokens from 0
            tokens = torch.arange(self.sink_tokens + self.window, device=self.pool.device)
            tokens = tokens.expand(self.table.num_rows, -1)  # [batch, num_keys]
            tokens = tokens.masked_fill(tokens >= end, -1)
        else:
            tokens = self._visible(start, num_new)  # [batch, num_keys]
        if capacity_pages is None and not self.sink_tokens:  # every row sees tokens [first, end): the same pages
            return self._page_ids()[:, first // page_size : -(-end // page_size)], None, tokens, first
        return *self._token_slots(tokens), tokens, first - sinks

    def _plan_gather(self, plan: StepPlan) -> None:
        """The base's, and a step of several tokens gets its band (``StepPlan.layout``)."""
        super()._plan_gather(plan)
        if plan.num_new > 1:
            pads = self._pad_tensor(plan.slots.shape[0])
            layout = band(plan.slots, plan.start, plan.num_new, self.window, self.sink_tokens, pads, self.is_sliding)
            plan.layout = KeyLayout(layout)

    def _visible(self, start: int, num_new: int) -> torch.Tensor:
        """``[batch, n]`` each row's tokens a step at ``start`` sees, in time order (``visible_span``): its own sinks,
        or where its window still reaches them the tokens just before it, then the window."""
        device, batch = self.pool.device, self.table.num_rows
        sinks, first = visible_span(start, num_new, self.window, self.sink_tokens)
        window = torch.arange(first, start + num_new, device=device).expand(batch, -1)  # [batch, end - first]
        if not sinks:
            return window
        sink_start = self._pad_tensor(batch).clamp(max=first - sinks).unsqueeze(1)  # [batch, 1]
        return torch.cat([sink_start + torch.arange(sinks, device=device), window], dim=1)

    def _token_slots(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The page and the slot in it ``[batch, n]`` of each row's tokens ``tokens [batch, n]`` (``-1``, or a
        token whose page the row does not hold: the null page's first slot)."""
        page_size, ids = self.pool.format.page_size, self._page_ids()
        held = (tokens >= 0) & (tokens < ids.shape[1] * page_size)
        pages = ids.gather(1, torch.where(held, tokens // page_size, 0)).masked_fill(~held, NULL_PAGE)
        offsets = torch.where(held & (pages != NULL_PAGE), tokens % page_size, 0)
        return pages, offsets

    # ----- reused prefixes (hf_kvcache.caches.prefix) -------------------------------------------

    def prefix_layout(self, num_pages: int) -> list[int | None]:
        """Which token page each page of a row holds right after its first ``num_pages`` full token pages were
        written in one step from token 0: its sink pages and those of its last ``reach`` tokens; holes between."""
        page_size, end = self.pool.format.page_size, num_pages * self.pool.format.page_size
        return [
            page if page * page_size < self.sink_tokens or (page + 1) * page_size > end - self.reach else None
            for page in range(num_pages)
        ]

    def token_page_position(self, token_page: int) -> int | None:
        """Where a full token page lies in the rows' pages, or ``None`` once a row gave it back."""
        held = all(token_page < len(row) and row[token_page] != NULL_PAGE for row in self.table.rows)
        return token_page if held else None
