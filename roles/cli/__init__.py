"""`rolectl`: run a role, a whole job, a dev server; inspect, replay and watch a job."""

from __future__ import annotations

import click

from .options import exit_codes_epilog
from .read import bench, dashboard, export, replay, status, track
from .run import auth, provision, server, start, up

__all__ = ["main"]


class _Commands(click.Group):
    """rolectl's commands. Output whose reader went away (`rolectl status | head`) ends quietly with
    0: the reader had what it wanted (click would say nothing and exit 1). `replay --check` keeps
    its verdict (roles.observe.replay)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            from rolectl.roles.observe.render import quiet_closed_stdout

            quiet_closed_stdout()
            ctx.exit(0)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]}, epilog=exit_codes_epilog())
@click.version_option(package_name="rolectl")
def main() -> None:
    """rolectl: RL fine-tuning roles coordinated over NATS.

    A trainer and explorers publish status and version events; a stateless synchronizer folds them
    and decides when weights move; weights travel out of band.
    """


for _command in (start, up, provision, auth, server, status, export, replay, dashboard, track, bench):
    main.add_command(_command)
