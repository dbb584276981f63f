"""`cli/options.py`'s option groups: a command parameter that stands for several options (`group`, `grouped`)."""

from __future__ import annotations

from typing import Annotated

import typer
from typer.testing import CliRunner

from specdec_cli.cli import options as o

A = Annotated[int, typer.Option("--a", help="first of the pair")]
B = Annotated[int, typer.Option("--b", help="second of the pair")]
C = Annotated[int, typer.Option("--c", help="third of the pair")]


def trio(a: A = 1, b: B = 2, c: C = 3) -> tuple[int, int, int]:
    return a, b, c


def command_app(command) -> typer.Typer:
    app = typer.Typer()
    app.command()(o.grouped(command))
    app.command("other")(lambda: None)  # two commands: the command's name is its first argument
    return app


def test_a_group_stands_for_its_options_in_its_place_and_the_command_gets_what_it_builds():
    seen = {}

    def cmd(
        first: Annotated[int, typer.Option("--first")] = 0,
        abc: tuple = o.group(trio, b=20, omit=("c",)),
        last: Annotated[int, typer.Option("--last")] = 9,
    ) -> None:
        seen.update(first=first, abc=abc, last=last)

    app = command_app(cmd)
    names = [p.name for p in typer.main.get_command(app).commands["cmd"].params]
    assert names == ["first", "a", "b", "last"]  # spliced in the group's place, --c omitted
    assert CliRunner().invoke(app, ["cmd", "--a", "5"]).exit_code == 0
    assert seen == {"first": 0, "abc": (5, 20, 3), "last": 9}  # b's new default, c the builder's own


def test_an_option_of_the_group_the_command_declares_stays_the_commands_and_reaches_the_builder():
    seen = {}

    def cmd(
        abc: tuple = o.group(trio),
        other: Annotated[int, typer.Option("--other")] = 0,
        a: Annotated[int, typer.Option("--a", help="the command's own --a")] = 7,
    ) -> None:
        seen.update(abc=abc, a=a)

    app = command_app(cmd)
    params = typer.main.get_command(app).commands["cmd"].params
    assert [p.name for p in params] == ["b", "c", "other", "a"]
    assert params[-1].help == "the command's own --a"
    assert CliRunner().invoke(app, ["cmd", "--c", "30"]).exit_code == 0
    assert seen == {"abc": (7, 2, 30), "a": 7}
