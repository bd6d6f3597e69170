"""The operator's web console: static HTML, CSS and JavaScript served by the admin HTTP
port at ``/``. No build step and no CDN: the files ship in the package and work offline.

How it works. The page polls the admin API (``/api/queues`` and
``/api/queues/{name}/inspect``) about once a second and redraws the queue table, each
group's partition map (state, owner, backlog, lag per partition) and its flows. It builds
every element with DOM calls and sets text with ``textContent``, so names and tags chosen
by clients are never interpreted as HTML.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

STATIC_DIR: Final = Path(__file__).parent

__all__ = ["STATIC_DIR"]
