"""SST trees for the peer scripts: PTB bracketed lines as nested (label, word) / (label, [children])."""


def parse(line):
    """PTB tree -> nested (label, word) / (label, [children]); tokens split on ' ' and parens only."""
    tokens, cur = [], ""
    for ch in line:
        if ch in "() \n":
            if cur:
                tokens.append(cur)
                cur = ""
            if ch in "()":
                tokens.append(ch)
        else:
            cur += ch
    stack, root = [], None
    for t in tokens:
        if t == "(":
            stack.append([None, None, []])
        elif t == ")":
            label, word, kids = stack.pop()
            node = (int(label), word if word is not None else kids)
            if stack:
                stack[-1][2].append(node)
            else:
                root = node
        elif stack[-1][0] is None:
            stack[-1][0] = t
        else:
            stack[-1][1] = t
    return root


def leaves(node, out):
    label, body = node
    if isinstance(body, str):
        out.append(body)
    else:
        for k in body:
            leaves(k, out)
    return out
