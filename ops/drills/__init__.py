"""Operating drills against a running stack (``laneway drill ...``): each drives traffic,
watches the stack, prints a verdict table and writes a PNG timeline."""

from ops.drills.commands import add_drill_commands

__all__ = ["add_drill_commands"]
