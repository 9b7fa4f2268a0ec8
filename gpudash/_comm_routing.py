"""Where the kernel handles what a page sends to gpudash's widgets.

JupyterLab 4.4 and later send each comm target's messages on a kernel *subshell* of its own
(a thread of ipykernel 7, so that a widget answers while a cell runs), and delete that
subshell when the page closes the last comm of the target. ipykernel 7 routes every message
that arrives for a comm to the subshell of the message that was the kernel's parent when the
comm last *sent* something (so that a reply reaches the loop that waits for it), not to the
subshell the message came on.

A gpudash widget sends from a thread of its own (the dashboard's refresher, a background
task's status), where the parent is whatever message the kernel handled last, often one of a
subshell the page deletes right after: ipywidgets' control comm, which a page opens to
restore its widgets and closes at once. Every later message from the page to that widget is
then routed to a subshell that no longer exists and dropped (the kernel logs "Cannot handle
comm_msg ...: unknown subshell"): after a reload the dashboard stays at "gpudash: loading the
views..." and its controls do nothing, until the widget happens to send again, which an idle
dashboard does not.

:func:`follow_the_page` makes a widget's comm take each message on the subshell it came on, as
the page asked. (gpudash's widgets never wait in the kernel for an answer from the page, the
case the routing is for; the request ids ipykernel keeps for it are dropped, so they do not
pile up with every reply.) Kernels without subshells have nothing to route and are left as
they are.
"""

from __future__ import annotations

from typing import Any

__all__ = ["follow_the_page"]


def follow_the_page(*widgets: Any) -> None:
    """Route what the page sends to each widget (and the widgets in its ``children``) to the
    subshell it was sent on.

    Parameters
    ----------
    *widgets : ipywidgets.Widget
        Widgets whose comms are open. A widget whose kernel routes no subshells (ipykernel
        before 7, another kernel) is left unchanged.
    """
    stack = list(widgets)
    while stack:
        w = stack.pop()
        stack.extend(getattr(w, "children", ()) or ())
        comm = getattr(w, "comm", None)
        route = getattr(comm, "_reply_subshell_for", None)
        if route is None or getattr(route, "follows_the_page", False):
            continue
        awaited = getattr(comm, "_reply_subshell_ids", None)
        lock = getattr(comm, "_reply_subshell_lock", None)

        def from_the_page(data: Any, default: Any, _awaited=awaited, _lock=lock) -> Any:
            if _awaited and _lock is not None:
                with _lock:
                    _awaited.clear()
            return default

        from_the_page.follows_the_page = True  # type: ignore[attr-defined]
        comm._reply_subshell_for = from_the_page
