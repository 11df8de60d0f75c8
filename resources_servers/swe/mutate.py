"""Procedural bug injection (SWE-smith's kinds): flip an operator, drop a branch, change a constant,
swap arguments. Each mutation edits one statement's lines of the source and nothing else, so its
diff is as small as the bug."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Iterator

FLIPS: dict[type, type] = {
    ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.And: ast.Or, ast.Or: ast.And,
}
KINDS = ("flip_operator", "drop_branch", "change_constant", "swap_arguments")


@dataclass(frozen=True)
class Mutation:
    kind: str
    line: int  # 1-based, where the edit starts
    function: str  # the enclosing function ("" at module level)
    before: str
    after: str
    source: str  # the whole mutated file


def _functions(tree: ast.AST) -> dict[ast.AST, str]:
    """Each node's enclosing function name."""
    owner: dict[ast.AST, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else name
            owner[child] = inner
            visit(child, inner)

    visit(tree, "")
    return owner


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _replace_span(lines: list[str], node: ast.AST, text: str) -> list[str] | None:
    """The file's lines with one single-line node's text replaced (offsets are UTF-8 bytes)."""
    if node.lineno != node.end_lineno:
        return None
    raw = lines[node.lineno - 1].encode()
    new = raw[: node.col_offset] + text.encode() + raw[node.end_col_offset:]
    return [*lines[: node.lineno - 1], new.decode(), *lines[node.lineno:]]


def _variant(node: ast.AST) -> tuple[str, ast.AST] | None:
    """The mutated copy of an expression node, and the mutation's kind; None if it has none."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in FLIPS:
        return "flip_operator", ast.Compare(node.left, [FLIPS[type(node.ops[0])]()], node.comparators)
    if isinstance(node, ast.BinOp) and type(node.op) in FLIPS:
        if isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
            return None  # string concatenation: "a" - "b" is only a TypeError
        return "flip_operator", ast.BinOp(node.left, FLIPS[type(node.op)](), node.right)
    if isinstance(node, ast.BoolOp) and len(node.values) == 2:
        return "flip_operator", ast.BoolOp(FLIPS[type(node.op)](), node.values)
    if (isinstance(node, ast.Constant) and type(node.value) is int and -2 <= node.value <= 100):
        return "change_constant", ast.Constant(node.value + 1 if node.value != 1 else 0)
    if (isinstance(node, ast.Call) and len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args[:2])
            and ast.unparse(node.args[0]) != ast.unparse(node.args[1])):
        return "swap_arguments", ast.Call(node.func, [node.args[1], node.args[0], *node.args[2:]], node.keywords)
    return None


def mutations(source: str) -> Iterator[Mutation]:
    """Every mutation of the module's functions, in source order."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    owner = _functions(tree)
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        function = owner.get(node, "")
        if not function or id(node) in docstrings or not hasattr(node, "lineno"):
            continue
        if isinstance(node, ast.If):
            yield from _drop_branch(node, tree, lines, function)
            continue
        variant = _variant(node)
        if variant is None:
            continue
        kind, replacement = variant
        before = ast.get_source_segment(source, node)
        after = ast.unparse(replacement)
        if before is None:
            continue
        changed = _replace_span(lines, node, after)
        if changed is None:
            continue
        text = "".join(changed)
        try:
            ast.parse(text)
        except SyntaxError:
            continue
        yield Mutation(kind, node.lineno, function, before, after, text)


def _drop_branch(node: ast.If, tree: ast.AST, lines: list[str], function: str) -> Iterator[Mutation]:
    """An `if` without `else` (not an elif) deleted, when its block keeps another statement."""
    if node.orelse:
        return
    for parent in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and node in block:
                if field == "orelse" and isinstance(parent, ast.If) or len(block) < 2:
                    return
                start, end = node.lineno - 1, node.end_lineno
                before = "".join(lines[start:end])
                text = "".join([*lines[:start], *lines[end:]])
                try:
                    ast.parse(text)
                except SyntaxError:
                    return
                yield Mutation("drop_branch", node.lineno, function, before.strip().splitlines()[0], "", text)
                return
