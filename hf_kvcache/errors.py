"""The two domain failures of hf_kvcache, and the error of a tool whose extra is not installed.

Bad input raises ``ValueError``/``TypeError`` instead."""


class PoolExhaustedError(RuntimeError):
    """A request needs more pages than the pool has free; nothing was allocated.

    Attributes:
        requested_pages: pages the failing request asked for.
        free_pages: pages free when it asked.
        total_pages: usable pages of the pool (the cap, for a pool that grows).
        exceeds_pool: the request needs more pages than the whole pool: it can never fit (otherwise it may once
            other requests give pages back).
    """

    def __init__(self, requested_pages: int, free_pages: int, total_pages: int, hint: str = "") -> None:
        self.requested_pages = requested_pages
        self.free_pages = free_pages
        self.total_pages = total_pages
        self.exceeds_pool = requested_pages > total_pages
        if self.exceeds_pool:
            message = (
                f"KV pool too small: the request needs {requested_pages} pages, more than the pool's {total_pages} "
                f"pages in all ({free_pages} free now), so it can never fit."
            )
        else:
            message = (
                f"KV pool exhausted: the request needs {requested_pages} pages but only {free_pages} of "
                f"{total_pages} are free now; the others are held by requests in flight."
            )
        super().__init__(f"{message} {hint}".strip())


class IncompatibleModelError(ValueError):
    """A model (or a pool built for another model) cannot be served by this cache."""


class MissingExtraError(ModuleNotFoundError):
    """A tool of hf_kvcache (evaluation, benchmarks, cards, the bundled model) needs a package the core leaves out.

    Attributes:
        extra: the extra that installs it (``pip install 'hf_kvcache[<extra>]'``), which the message names.
        name: the missing module, as ``ModuleNotFoundError.name``.
    """

    def __init__(self, extra: str, needed_by: str, module: str | None) -> None:
        self.extra = extra
        super().__init__(
            f"{needed_by} needs the package {module!r}, which hf_kvcache's core install leaves out: "
            f"pip install 'hf_kvcache[{extra}]'",
            name=module,
        )
