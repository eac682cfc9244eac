"""Prompt reuse across ``generate`` calls: a cache's side of its pool's prefix index (``memory.prefix_index``).

``hf_kvcache.integration.seams`` hands a cache the token ids ``generate`` never shows it. A ``PrefixTracker`` keeps
them with each row's chain keys, **looks up** a prompt before the first pass (``reuse``: the longest prefix of whole
pages, at most ``prompt - 1`` tokens, every row finds for every layer group, attached copy-on-write; the pool's tiers
asked first, outside its lock) and **publishes** each full page once every layer of its group wrote it.

A page must not depend on how the tokens before it were split into passes, so a tracker refuses what it cannot make
exact (docs/prefix-caching.md lists each case). What rows hold besides their pages (a quantized cache's exact values,
a hybrid model's states) is a tail kept beside the entry of the prefix's last page, at the boundaries a later call is
likely to start from (``_capture``). A tracker whose cache held pages across ``KVPool.reset_prefix_index`` publishes
nothing more (``epoch``).
"""

import logging
from collections import Counter
from typing import Any

import torch

from hf_kvcache.attention.interface import ATTENTION_NAME
from hf_kvcache.caches.fingerprint import UnreadableWeights, model_fingerprint
from hf_kvcache.caches.policy import RowPolicy
from hf_kvcache.caches.state_tails import StateTail, StateTails
from hf_kvcache.layers import PagedRows
from hf_kvcache.layers.exact import ExactTail
from hf_kvcache.memory.allocator import NULL_PAGE
from hf_kvcache.memory.page_bytes import PageData
from hf_kvcache.memory.page_pool import PagePool
from hf_kvcache.memory.prefix_index import STATE_GROUP, PageKey, chain_keys, root_key, tail_key
from hf_kvcache.transformers_internals import attn_implementation

logger = logging.getLogger("hf_kvcache")

TOKEN_INPUTS = ("attention_mask", "position_ids")
"""Tensor inputs a call may bring besides its token ids and still take part (``pixel_values`` and others refuse)."""
MAX_TIER_ASKS = 4
"""Times one lookup asks the pool's tiers (each a round trip to a store) for the pages of a shorter prefix."""

_logged: set[str] = set()


def log_once(reason: str) -> None:
    """Logs why prompts are not reused, once per reason and process."""
    if reason not in _logged:
        _logged.add(reason)
        logger.warning("Prefix caching is off for this call: %s", reason)


class PrefixTracker:
    """The token ids a cache's rows hold, their chain keys, and what the cache has published, on one pool (a
    ``KVPool``'s ``pages`` with a prefix index); ``policies``: each layer group's; pages are published and found
    under ``namespace`` only."""

    def __init__(self, pool: PagePool, policies: list[RowPolicy], namespace: str = "") -> None:
        self.pool = pool
        self.namespace = namespace
        self.page_size = pool.format.page_size
        self.policies = policies
        self.active = True  # False once a call could not say which tokens the rows hold: nothing more is published
        self.epoch = pool.prefix_epoch  # the index's reset count when the cache began holding its pages
        self.root: bytes | None = None
        self.num_recorded = 0  # tokens of every row recorded in _tokens, from the first on
        self._tokens: torch.Tensor | None = None  # [rows, capacity] int64 on the CPU
        self._clean: list[bool] = []  # rows without padding, at the positions of their tokens
        self._chains: list[list[bytes]] = []  # each row's chain keys, token page by token page
        self._published: dict[int, int] = {}  # layer group -> token pages published (or past publishing)
        self.states: StateTails | None = None  # the cache's state layers' tails (a hybrid model's), set per call

    # ----- a generate call --------------------------------------------------------------------

    def begin_call(
        self, model: torch.nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any], refusal: str | None = None
    ) -> bool:
        """Checks a call's first inputs (``input_ids [rows, length]``, the other ``prepare_inputs_for_generation``
        arguments, the cache's own ``refusal``); False, and nothing published from now on, if it cannot take part."""
        reason = refusal or self._refusal(model, inputs)
        root = None
        if reason is None:
            try:
                root = root_key(model_fingerprint(model), self.namespace, self.page_size, *self._signature())
            except UnreadableWeights as error:
                reason = str(error)
        if reason is None and self.root is not None and root != self.root:
            reason = "the cache continues with another model."
        if reason is not None:
            log_once(reason)
            self.active = False
        if not self.active:
            return False
        self.root = root
        if self._tokens is None:
            self._clean = self._clean_rows(input_ids, inputs)
        return True

    def reuse(self, rows_of: "dict[int, PagedRows]", input_ids: torch.Tensor) -> int:
        """Attaches to the empty rows of each layer group the longest prefix of whole pages of ``input_ids [rows,
        length]`` every row finds for every layer group; returns its tokens."""
        num_rows, length = input_ids.shape
        self._record(0, input_ids)
        lookup = max(0, length - 1) // self.page_size
        num_pages = found = 0
        if all(self._clean) and lookup:
            self._extend_chains(lookup)
            num_pages, found = self._lookup(rows_of, lookup)
        if all(self._clean):  # the prompt's whole pages, and where it parts from what the index holds
            self._capture(rows_of, [lookup, length // self.page_size, found], num_pages)
        reused = num_pages * self.page_size
        self.pool.record_prefix_lookup(num_rows, reused, length)
        self._published = dict.fromkeys(rows_of, num_pages)
        return reused

    def _lookup(self, rows_of: "dict[int, PagedRows]", num_pages: int) -> tuple[int, int]:
        """Attaches the longest prefix (at most ``num_pages`` token pages) the index and the tiers hold for every row
        and layer group, with the rows' ``ExactTail`` where they need one; returns the token pages attached and
        those found."""
        fetched: dict[PageKey, tuple[str, PageData]] = {}
        tails: dict[PageKey, ExactTail] = {}
        if self.pool.tiers is not None:
            num_pages, fetched = self._fetch(rows_of, num_pages)
            tails = self._fetch_tails(rows_of, num_pages)
        with self.pool.held():  # found pages are taken before anything can evict them
            taken = self.pool.restore(list(self._keys(rows_of, num_pages)), fetched) if fetched else []
            self.pool.publish_tails(list(tails.items()))  # beside the pages the index holds now
            found = self._longest(rows_of, num_pages)
            num_pages, row_tails = self._with_tails(rows_of, found)
            if num_pages:
                self._attach(rows_of, num_pages, row_tails)
            self.pool.free(taken)  # the rows hold what they attached; the rest is cached again
        tiers = {key: tier for key, (tier, _) in fetched.items()}
        self.pool.record_tier_hits([tiers.get(key, "device") for key in self._keys(rows_of, num_pages).elements()])
        return num_pages, found

    def record(self, start: int, fed_ids: torch.Tensor | None, rows_of: "dict[int, PagedRows]") -> None:
        """Records the ids ``[rows, n]`` a forward pass is about to write at ``start`` (``None``, embeddings: stops
        the tracking) and publishes the pages written so far."""
        if not self.active:
            return
        if fed_ids is None or start > self.num_recorded:  # tokens the tracker never saw: nothing more is known
            self.active = False
            return
        self._record(start, fed_ids)
        if self.states is not None:  # the states hold the first `start` tokens
            self.states.capture(start, self.page_size)
        self.publish(rows_of)

    def publish(self, rows_of: "dict[int, PagedRows]", final: bool = False) -> None:
        """Publishes every full page each clean row holds that every layer has written and that is not yet, and the
        ``ExactTail`` the rows kept (``final``, as the cache lets its rows go: the newest one's too)."""
        if self.active and self.epoch != self.pool.prefix_epoch:  # reset since: what the rows hold may be stale
            self.active = False
        if not self.active or self.root is None:
            return
        page_size = self.page_size
        pages: list[tuple[PageKey, int]] = []
        for layer_group, rows in rows_of.items():
            end = min(rows.written, self.num_recorded)
            first, last = self._published.get(layer_group, 0), end // page_size
            if last <= first or rows.table.num_rows != len(self._clean):
                continue
            self._extend_chains(last)
            for token_page in range(first, last):
                position = rows.token_page_position(token_page)
                if position is None:
                    continue
                for row, clean in enumerate(self._clean):
                    if clean:
                        pages.append(((self._chains[row][token_page], layer_group), rows.table.rows[row][position]))
            self._published[layer_group] = last
        if pages:
            self.pool.publish(pages)
        tails = []
        for layer_group, holder in self._holders(rows_of).items():
            for row_tails in holder.take_tails(final):
                if len(row_tails) != len(self._clean):
                    continue
                token_page = row_tails[0].end // page_size - 1
                self._extend_chains(token_page + 1)
                tails += [
                    ((chain[token_page], layer_group), tail)
                    for chain, clean, tail in zip(self._chains, self._clean, row_tails)
                    if clean and token_page < len(chain)
                ]
        kept = self.pool.publish_tails(tails) if tails else []
        if kept and self.pool.tiers is not None:
            self.pool.tiers.publish_tails([(tail_key(key), PageData(tail.to_tensors())) for key, tail in kept])

    # ----- row changes ------------------------------------------------------------------------

    def select_rows(self, indices: list[int]) -> None:
        """Keeps rows ``indices`` in that order (beam reorders, repeats)."""
        if self._tokens is None or any(not 0 <= index < len(self._clean) for index in indices):
            return
        self._tokens = self._tokens[torch.tensor(indices)]
        built = len(self._chains) == len(self._clean)  # chain keys are computed on demand (_extend_chains)
        self._chains = [list(self._chains[index]) for index in indices] if built else []
        self._clean = [self._clean[index] for index in indices]

    def crop(self, num_tokens: int) -> None:
        self.num_recorded = min(self.num_recorded, num_tokens)
        pages = num_tokens // self.page_size
        self._chains = [chain[:pages] for chain in self._chains]
        self._published = {layer_group: min(count, pages) for layer_group, count in self._published.items()}

    def reset(self) -> None:
        """Forgets the tokens (the cache was emptied)."""
        self.active, self.root, self.num_recorded = True, None, 0
        self.epoch = self.pool.prefix_epoch
        self._tokens, self._clean, self._chains, self._published = None, [], [], {}

    # ----- internals ------------------------------------------------------------------------

    def _signature(self) -> list[tuple[int | None, int, bool]]:
        """What each layer group's attention sees: pages of caches that differ here never mix."""
        return [(policy.window, policy.sink_tokens, policy.is_sliding) for policy in self.policies]

    def _refusal(self, model: torch.nn.Module, inputs: dict[str, Any]) -> str | None:
        """Why this call cannot take part (``None``: it can)."""
        if inputs.get("inputs_embeds") is not None:
            return "the prompt comes as inputs_embeds, not token ids."
        mask = inputs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim != 2:
            return f"the call brings a {mask.ndim}-D attention mask, whose pattern the prefix index cannot key on."
        others = sorted(
            key for key, value in inputs.items() if isinstance(value, torch.Tensor) and key not in TOKEN_INPUTS
        )
        if others:
            return f"the call brings inputs {others} besides token ids, which the prefix index cannot key on."
        for policy in self.policies:
            if policy.window is None:
                continue
            attention = attn_implementation(model.config)
            if not policy.is_sliding and attention != ATTENTION_NAME:
                return (
                    f"the cache imposes window={policy.window} under {attention!r} attention, where a prompt past the "
                    f'window attends in full; load the model with attn_implementation="{ATTENTION_NAME}" to reuse '
                    "prompts."
                )
        return None

    def _clean_rows(self, input_ids: torch.Tensor, inputs: dict[str, Any]) -> list[bool]:
        """Rows without padding whose positions are their token indices."""
        num_rows, length = input_ids.shape
        clean = torch.ones(num_rows, dtype=torch.bool)
        mask = inputs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            clean &= mask.bool().all(dim=-1).cpu()
        positions = inputs.get("position_ids")  # [rows, length] as generate makes them
        if isinstance(positions, torch.Tensor):
            if positions.shape != (num_rows, length):  # another layout (e.g. 3D rope): nothing to compare with
                return [False] * num_rows
            clean &= (positions == torch.arange(length, device=positions.device)).all(dim=-1).cpu()
        return clean.tolist()

    def _record(self, start: int, ids: torch.Tensor) -> None:
        """Writes ``ids [rows, n]`` at tokens ``[start, start + n)`` of every row (the rows' tokens end there)."""
        num_rows, num_new = ids.shape
        end = start + num_new
        tokens = self._tokens
        if tokens is None or tokens.shape[0] != num_rows or tokens.shape[1] < end:
            capacity = max(end, 2 * tokens.shape[1] if tokens is not None else 0)
            grown = torch.zeros(num_rows, capacity, dtype=torch.long)
            if tokens is not None and tokens.shape[0] == num_rows:
                grown[:, : self.num_recorded] = tokens[:, : self.num_recorded]
            self._tokens = tokens = grown  # [rows, capacity]
        tokens[:, start:end] = ids.detach().to("cpu", torch.long)
        self.num_recorded = end
        pages = start // self.page_size  # chain keys past the first page written now may change
        if any(len(chain) > pages for chain in self._chains):
            self._chains = [chain[:pages] for chain in self._chains]
            self._published = {layer_group: min(count, pages) for layer_group, count in self._published.items()}

    def _extend_chains(self, num_pages: int) -> None:
        """Computes each row's chain keys up to token page ``num_pages`` (recorded tokens only)."""
        num_pages = min(num_pages, self.num_recorded // self.page_size)
        if len(self._chains) != len(self._clean):
            self._chains = [[] for _ in self._clean]
        page_size = self.page_size
        for row, chain in enumerate(self._chains):
            if len(chain) < num_pages:
                ids = self._tokens[row, len(chain) * page_size : num_pages * page_size].tolist()
                chain += chain_keys(chain[-1] if chain else self.root, ids, page_size)

    def _keys(self, rows_of: "dict[int, PagedRows]", num_pages: int) -> Counter[PageKey]:
        """The page keys a prefix of ``num_pages`` token pages attaches (``prefix_layout``), with how many rows want
        each."""
        return Counter(
            (chain[d], layer_group)
            for layer_group, rows in rows_of.items()
            for d in (rows.prefix_layout(num_pages) if num_pages else [])
            if d is not None
            for chain in self._chains
        )

    def _fetch(
        self, rows_of: "dict[int, PagedRows]", num_pages: int
    ) -> tuple[int, dict[PageKey, tuple[str, PageData]]]:
        """Outside the pool's lock (the tiers may be a network away): the longest prefix (at most ``num_pages`` token
        pages) the index and the tiers hold together, and the pages fetched of it with their tier. The prefix stops
        below a growing layer group's first missing page, else shrinks a page at a time; ``MAX_TIER_ASKS`` asks."""
        fetched: dict[PageKey, tuple[str, PageData]] = {}
        asked: set[PageKey] = set()
        num_asks = 0
        while num_pages:
            with self.pool.held():
                absent = [key for key in self._keys(rows_of, num_pages) if self.pool.lookup(key) is None]
            new = [key for key in absent if key not in asked]
            if new and num_asks < MAX_TIER_ASKS:
                asked.update(new)
                fetched.update(self.pool.tiers.fetch(new))
                num_asks += 1
            missing = {key for key in absent if key not in fetched}
            if not missing:
                break
            shorter = num_pages - 1
            for layer_group, rows in rows_of.items():
                if rows.prefix_layout(num_pages) == list(range(num_pages)):  # every token page, in order
                    for chain in self._chains:
                        shorter = min([shorter, *(d for d in range(num_pages) if (chain[d], layer_group) in missing)])
            num_pages = shorter
        return num_pages, fetched

    def _fetch_tails(self, rows_of: "dict[int, PagedRows]", num_pages: int) -> dict[PageKey, Any]:
        """Outside the pool's lock: the tails the pool's tiers hold at the ends of the rows' first ``num_pages`` token
        pages that its index lacks, for what needs one (``_holders``)."""
        wanted = [
            (chain[d], layer_group)
            for layer_group in self._holders(rows_of)
            for chain in self._chains
            for d in range(num_pages)
        ]
        with self.pool.held():
            wanted = [key for key in dict.fromkeys(wanted) if self.pool.tail(key) is None]
        found = self.pool.tiers.fetch([tail_key(key) for key in wanted], tails=True) if wanted else {}
        tails = {
            key: (StateTail if key[1] == STATE_GROUP else ExactTail).from_tensors(
                found[tail_key(key)][1].tensors, self.pool.device
            )
            for key in wanted
            if tail_key(key) in found
        }
        return {key: tail for key, tail in tails.items() if tail is not None}

    def _longest(self, rows_of: "dict[int, PagedRows]", num_pages: int) -> int:
        """The most token pages (at most ``num_pages``) whose pages every row finds for every layer group."""
        pool, chains = self.pool, self._chains
        for layer_group, rows in rows_of.items():  # a layer group keeping every token needs every page: a run from 0
            if rows.window is None:
                num_pages = min(
                    num_pages,
                    *(
                        next((d for d in range(num_pages) if pool.lookup((chain[d], layer_group)) is None), num_pages)
                        for chain in chains
                    ),
                )
        windows = {layer_group: rows for layer_group, rows in rows_of.items() if rows.window is not None}
        while num_pages and not all(
            pool.lookup((chain[d], layer_group)) is not None
            for layer_group, rows in windows.items()
            for d in rows.prefix_layout(num_pages)
            if d is not None
            for chain in chains
        ):
            num_pages -= 1
        return num_pages

    def _holders(self, rows_of: "dict[int, PagedRows]") -> dict[int, Any]:
        """What keeps a tail beside the pages, by the layer group it is kept under: the rows that keep tokens in full
        precision beside their codes (``SlotStore.keeps_exact``), and the state layers (``STATE_GROUP``)."""
        holders = {layer_group: rows.store for layer_group, rows in rows_of.items() if rows.store.keeps_exact}
        return holders | ({STATE_GROUP: self.states} if self.states is not None else {})

    def _capture(self, rows_of: "dict[int, PagedRows]", token_pages: list[int], reused: int = 0) -> None:
        """Has each tail holder (``_holders``) keep its tail at the end of each of ``token_pages`` past ``reused``
        that the prompt's prefill writes, where the index has none yet (published with the pages: ``publish``)."""
        page_size = self.page_size
        self._extend_chains(max(token_pages, default=0))
        for layer_group, holder in self._holders(rows_of).items():
            holder.keeps_newest = True  # where the rows end: the prefix a later turn of theirs starts with
            for pages in set(token_pages):
                if reused < pages <= len(self._chains[0]) and not all(self._tails(holder, layer_group, pages)):
                    holder.captures.append(pages * page_size)

    def passed(self, end: int, rows_of: "dict[int, PagedRows]") -> None:
        """A prefill's last pass has run: keeps the states of its first ``end`` tokens if a later call may start there
        (``record`` keeps them before a pass only, and none may follow) and publishes."""
        if self.active and self.states is not None:
            self.states.capture(end, self.page_size)
            self.publish(rows_of)

    def pass_ends(self, start: int, length: int) -> list[int]:
        """Where the forward passes of a prefill of tokens ``[start, length)`` end: at each page boundary whose states
        the state layers keep (a state exists only where a pass ends), then at ``length``."""
        captures = self.states.captures if self.states is not None and self.active else []
        return sorted({end for end in captures if start < end < length} | {length})

    def _with_tails(self, rows_of: "dict[int, PagedRows]", num_pages: int) -> tuple[int, dict[int, list[Any]]]:
        """The most token pages (at most ``num_pages``) at whose end every row finds a tail for every holder
        (``_holders``), and those tails (layer group -> one per row). Hold the pool's lock."""
        holders = self._holders(rows_of)
        for pages in range(num_pages, 0, -1):
            tails = {layer_group: self._tails(holder, layer_group, pages) for layer_group, holder in holders.items()}
            found = all(all(row_tails) for row_tails in tails.values())
            if found and (pages == num_pages or self._longest(rows_of, pages) == pages):  # a window's other pages
                return pages, tails
        return 0, {}

    def _tails(self, holder: Any, layer_group: int, num_pages: int) -> list[Any]:
        """Each row's tail at the end of token page ``num_pages - 1`` that serves ``holder`` (``None``: none)."""
        tails = [self.pool.tail((chain[num_pages - 1], layer_group)) for chain in self._chains]
        return [tail if tail is not None and tail.covers(*holder.exact_lengths) else None for tail in tails]

    def _attach(self, rows_of: "dict[int, PagedRows]", num_pages: int, tails: dict[int, list[Any]]) -> None:
        """Takes the prefix's pages and attaches them (a window's holes: the null page), with the rows' ``tails``."""
        pool = self.pool
        layouts = {layer_group: rows.prefix_layout(num_pages) for layer_group, rows in rows_of.items()}
        pages = {
            layer_group: [
                [NULL_PAGE if d is None else pool.lookup((chain[d], layer_group)) for d in layout]
                for chain in self._chains
            ]
            for layer_group, layout in layouts.items()
        }
        pool.share([page for table in pages.values() for row in table for page in row if page != NULL_PAGE])
        for layer_group, table in pages.items():
            rows_of[layer_group].attach(table, num_pages * self.page_size, tails.get(layer_group))
        if STATE_GROUP in tails:
            self.states.attach(num_pages * self.page_size, tails[STATE_GROUP])
