"""The calculator as an MCP tool server (stdio): `python examples/mcp_calc/calc_server.py`."""

from __future__ import annotations

import ast
import operator

from mcp.server.mcpserver import MCPServer

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

server = MCPServer("calculator")


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError("only numbers, + - * / and parentheses")


@server.tool()
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    try:
        value = _evaluate(ast.parse(expression, mode="eval"))
    except (ValueError, SyntaxError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


if __name__ == "__main__":
    server.run("stdio")
