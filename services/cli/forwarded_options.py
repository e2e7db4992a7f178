"""Options one command takes on behalf of another and gives back on its command line: `epdserve up` takes every
option of the engine services and of the proxy (but those it sets itself) and starts each service with the ones
given to it."""
from __future__ import annotations

import argparse
import json


class ForwardedOptions:
    """The options of `source` (a service's parser) that `target` (a group of `up`'s parser) takes for it."""

    def __init__(self, target: argparse._ActionsContainer, source: argparse.ArgumentParser, skip: set[str]) -> None:
        """Every optional of `source` but help, hidden aliases and those with a name in `skip`; one that `target`'s
        parser has already (taken for another service) is shared, not added twice."""
        taken = target._option_string_actions
        self.actions: list[argparse.Action] = []
        for action in source._actions:
            if (not action.option_strings or isinstance(action, argparse._HelpAction)
                    or action.help == argparse.SUPPRESS or skip.intersection(action.option_strings)):
                continue
            shared = taken.get(action.option_strings[0])
            if shared is None:
                target._add_action(action)
            self.actions.append(shared or action)

    def argv(self, args: argparse.Namespace) -> list[str]:
        """The command-line arguments that give a service the values `args` holds other than the defaults."""
        out: list[str] = []
        for action in self.actions:
            value = getattr(args, action.dest, action.default)
            if value == action.default:
                continue
            flag = action.option_strings[0]
            if isinstance(action, argparse.BooleanOptionalAction):
                out.append(flag if value else action.option_strings[1])
            elif action.nargs == 0:  # store_true and the like
                out.append(flag)
            elif isinstance(action, argparse._AppendAction):
                out += [arg for item in value for arg in (flag, _token(item))]
            elif isinstance(value, (list, tuple)):
                out += [flag, *map(_token, value)]
            else:
                out += [flag, _token(value)]
        return out


def _token(value) -> str:
    """A parsed value as its option's type reads it back (dicts are JSON)."""
    return json.dumps(value) if isinstance(value, dict) else str(value)
