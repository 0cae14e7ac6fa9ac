"""Event loops that finish their tasks before they close.

Orbax runs each of its synchronous calls on an event loop of its own and
closes it as soon as the call returns (`asyncio_utils.run_sync`). When one
of a call's concurrent TensorStore reads fails (a damaged checkpoint's
metadata: every array of the checkpoint is opened at once and the first
failure ends the call), the others are still in flight; each one that
finishes later hands its result to the closed loop, and TensorStore prints
`RuntimeError: Event loop is closed` with a traceback, as late as at the
process's exit, after the command's one-line error. A read that failed
just as the loop stopped is done, but the callback by which the call's
`gather` takes its error is still queued: closed unrun, asyncio logs
`Task exception was never retrieved` with a traceback when the task is
collected. Loops of `FinishingPolicy` run their pending tasks and queued
callbacks to their end when closed.
"""

import asyncio


class FinishingLoop(asyncio.SelectorEventLoop):
  """A loop whose `close` first runs its pending tasks and queued callbacks
  to their end (the tasks' errors dropped: whoever awaited them has its
  answer already)."""

  def close(self) -> None:
    if not self.is_closed() and not self.is_running():
      while True:
        pending = asyncio.all_tasks(self)
        # One more turn of the loop runs every callback queued before it.
        self.run_until_complete(
            asyncio.gather(*pending, self.create_task(asyncio.sleep(0)),
                           return_exceptions=True))
        if not pending:
          break
    super().close()


class FinishingPolicy(asyncio.DefaultEventLoopPolicy):

  def new_event_loop(self) -> asyncio.AbstractEventLoop:
    return FinishingLoop()


def install() -> None:
  """Makes every event loop made from now on a `FinishingLoop`."""
  asyncio.set_event_loop_policy(FinishingPolicy())
