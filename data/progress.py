"""Progress bars for long work (tokenization, perplexity, attention statistics): rich, on
stderr, drawn only on a terminal (a log file or a pipe gets no bar lines)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@contextlib.contextmanager
def progress_bar(description: str, total: int | None, console: Console | None = None) -> Iterator[Callable[[int], None]]:
    """Yields `advance(n)`; the bar (done / total, elapsed, remaining; a count when `total` is
    None) disappears when done."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield lambda n=1: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)


def tracked(items: Iterable, description: str, total: int | None, console: Console | None = None) -> Iterator:
    """`items`, advancing a progress bar by one per item."""
    with progress_bar(description, total, console) as advance:
        for item in items:
            yield item
            advance(1)
