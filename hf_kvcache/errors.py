"""The two domain failures of hf_kvcache. Bad input raises ``ValueError``/``TypeError`` instead."""


class PoolExhaustedError(RuntimeError):
    """A request needs more pages than the pool has free; nothing was allocated.

    Attributes:
        requested_pages: pages the failing request asked for.
        free_pages: pages free when it asked.
        total_pages: usable pages of the pool (the cap, for a pool that grows).
    """

    def __init__(self, requested_pages: int, free_pages: int, total_pages: int, hint: str = "") -> None:
        self.requested_pages = requested_pages
        self.free_pages = free_pages
        self.total_pages = total_pages
        message = (
            f"KV pool exhausted: the request needs {requested_pages} pages but only {free_pages} of "
            f"{total_pages} are free."
        )
        super().__init__(f"{message} {hint}".strip())


class IncompatibleModelError(ValueError):
    """A model (or a pool built for another model) cannot be served by this cache."""
