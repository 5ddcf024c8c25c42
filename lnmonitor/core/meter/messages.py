"""What the meter says, in words: each function takes what the meter decided and returns the sentence,
starting with ``name``, the monitor the user made (``LayerNormMonitor``, ``LNMonitorCallback``, ...)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lnmonitor.core.output.metric_names import ladder_metric

__all__ = [
    "Roles", "compiled_message", "decoder_padding_message", "forward_only_message", "layout_message",
    "narrow_message", "no_backward_message", "off_reason", "padding_message", "reused_message",
    "roles_message", "row_mask_message", "short_ladder_message", "some", "span", "unmasked_message",
    "unmeasured_message", "vanished_grad_message", "zero_grad_message",
]


@dataclass(frozen=True)
class Roles:
    """The meter's role decision for one model, in forward order: ``ladders`` each stack's rungs
    (``{stack: [name, ...]}``), ``finals`` each stack's final norm, ``main`` the stack of the model's ladder
    (before the logits), ``others`` ``[(name, role), ...]`` of the norms that are not rungs, ``post`` each
    stack's post-sublayer norms."""

    ladders: Mapping[str, list[str]]
    finals: Mapping[str, str]
    main: str
    others: list[tuple[str, str]] = field(default_factory=list)
    post: Mapping[str, list[str]] = field(default_factory=dict)


def some(names: Sequence[str], limit: int = 4) -> str:
    """The first ``limit`` names, comma-separated, and ``, ...`` when there are more."""
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def span(rungs: Sequence[str], final: str | None) -> str:
    """``"<n> rungs, the norms that read the residual stream (<first> ... <last>), final norm <name>"``, or
    a final norm alone (post-LN: BERT's MLM head)."""
    if len(rungs) == 1 and rungs[0] == final:
        return f"1 rung, its final norm {final!r} alone (no other norm's input flows on past it)"
    ends = f"{rungs[0]} ... {rungs[-1]}" if rungs else "- ... -"
    return (f"{len(rungs)} rungs, the norms that read the residual stream ({ends}), "
            f"final norm {repr(final) if final else 'none'}")


def roles_message(name: str, roles: Roles, ladder_named: bool) -> str:
    """What the roles found: each stack's ladder and the norms of other roles (said once)."""
    main, models = roles.main, ", the model's ladder (its final norm is the one before the logits),"
    if len(roles.ladders) == 1:
        said = f"{name}: the ladder has {span(roles.ladders[main], roles.finals.get(main))}"
    else:
        each = [f"{stack!r}{models if stack == main else ''} has {span(names, roles.finals.get(stack))}"
                + (f", logged as {ladder_metric('...', '' if stack == main else stack)}"
                   if len(names) > 1 else "") for stack, names in roles.ladders.items()]
        said = (f"{name}: {len(roles.ladders)} stacks, each its own residual stream and ladder: "
                + "; ".join(each))
    if roles.others:
        groups = sorted({role for _, role in roles.others})
        said += (f"; {len(roles.others)} norms of other roles ({', '.join(groups)}: "
                 f"{some([norm for norm, _ in roles.others], 3)}) are measured but are not rungs")
    return said + (" (as ladder=... says)." if ladder_named else "; ladder=[...] names the rungs instead.")


def short_ladder_message(name: str, roles: Roles) -> str | None:
    """Why no attenuation or growth is logged for a ladder of fewer than two rungs, or None."""
    short = {stack: names for stack, names in roles.ladders.items() if len(names) < 2}
    if not short:
        return None
    count = sum(len(names) for names in short.values())
    post = [norm for stack in short for norm in roles.post.get(stack, ())]
    why = (f"no pre-norm ladder: {len(post)} norms normalise a sublayer's output (post-LN, as "
           "BERT's), and sigma is logged per norm" if post and len(post) >= count else
           "only these norms read the residual stream")
    which = (f"the ladder has {count} rung(s)" if len(roles.ladders) == 1 else ", ".join(
        f"the ladder of {stack!r} has {len(names)} rung(s)" for stack, names in short.items()))
    return (f"{name}: {which}, so no attenuation or growth is logged: {why}. Name the rungs with "
            "ladder=[...] if they are others.")


def reused_message(name: str, names: Sequence[str]) -> str:
    return (f"{name}: the forward calls {some(names)} more often than the other norms (a block looped or "
            "shared, as in ALBERT): each one's statistics pool its calls, and it is kept out of the ladder, "
            "whose rungs are one depth each. Said once.")


def unmeasured_message(name: str, label: str, missing: Sequence[str], selected: int) -> str:
    """Selected norms had no row in a measured step: the forward does not call them or hooks cannot see it."""
    if len(missing) == selected:
        what = f"none of the {len(missing)} selected norms ran with gradient"
    else:
        what = f"{len(missing)} of the {selected} selected norms did not run with gradient"
    return (f"{name}: {what} during {label} ({some(missing, 8)}), so nothing is logged for them. Either "
            "the forward does not call these modules (leave them out with exclude=[...]) or it runs code the "
            "module hooks cannot see (torch.compile without torch.compiler.set_stance, TorchScript). "
            "Said once.")


def no_backward_message(name: str, label: str) -> str:
    return (f"{name}: {label} ran its forward but no backward (the training step returned no "
            "loss?): nothing is logged for it.")


def padding_message(name: str, source: str | None) -> str:
    return (f"{name}: {source} marks padding; its rows are left out of every statistic (sigma, rms, eps/var, "
            "the shares), and skipped_rows does not count them. Said once.")


def unmasked_message(name: str, source: str | None, names: Sequence[str]) -> str:
    return (f"{name}: {source} does not line up with the rows of {some(names)}: their statistics count every "
            "row, padding included. Pass row_mask= for them, or leave them out with exclude=. Said once.")


def zero_grad_message(name: str, zero: Sequence[tuple[str, int]]) -> str:
    """Rows without gradient because their position has no target: ``[(norm, rows), ...]``, first named."""
    (norm, count), more = zero[0], " (and of other norms)" if len(zero) > 1 else ""
    return (f"{name}: {count} rows of {norm}{more} carry no gradient because their position has no "
            "target (the final norm has none there either: a label of -100, e.g. a masked prompt or "
            "a packing separator, or a causal LM's last token): they have no share and are counted in "
            "zero_grad_rows, not in skipped_rows, which counts faults (non-finite or constant rows). "
            "Said once.")


def vanished_grad_message(name: str, vanished: Sequence[tuple[str, int, int]]) -> str:
    """Rows whose position had a target and whose gradient vanished: ``[(norm, rows, of rows), ...]``, the
    largest share named."""
    norm, count, rows = max(vanished, key=lambda v: v[1] / max(v[2], 1))
    more = f" (and rows of {len(vanished) - 1} other norms)" if len(vanished) > 1 else ""
    return (f"{name}: {count} of {rows} rows of {norm}{more} carry no gradient where the final norm's "
            "rows at the same positions do (their position had a target): a gradient that vanished, a "
            "fault (saturated attention or activations, a collapsing stream), counted in "
            "vanished_grad_rows. Said once.")


def forward_only_message(name: str, names: Sequence[str]) -> str:
    return (f"{name}: no gradient reaches {some(names)} (frozen inputs and gain, e.g. frozen embeddings or "
            "LoRA): their sigma, rms, eps/var and transmission come from the forward, and they have no "
            "share. Said once.")


def off_reason(err: BaseException) -> str:
    """Why the meter turned itself off: a norm's hook raised ``err``."""
    return (f"measuring a step failed inside a norm's hook ({type(err).__name__}: {err}); training goes on. "
            "If a norm computes something lnmonitor misreads, leave it out with exclude=[...].")


def narrow_message(name: str, norm: str, width: int, dead_dim: int, kind: str) -> str:
    """The refusal of a norm no wider than its dead subspace."""
    return (f"{name}: norm {norm!r} has width {width}, not more than its dead-subspace dimension {dead_dim} "
            f"({kind} norm): the dead subspace is the whole space and the share is trivially 1. Leave it out "
            f"with exclude=[{norm!r}].")


def layout_message(name: str, refused: Mapping[str, str]) -> str:
    """Norms whose rows are laid out across processes where they cannot be read: ``{norm: why}``."""
    return (f"{name}: the rows of {len(refused)} norm(s) are laid out across processes in a way they "
            "cannot be read from, so they are not measured (the other norms are): "
            + "; ".join(f"{norm}: {why}" for norm, why in list(refused.items())[:4])
            + ("; ..." if len(refused) > 4 else "") + ". Said once.")


def compiled_message(name: str) -> str:
    return (f"{name}: the model is compiled (torch.compile); its measured steps run eagerly "
            "(torch.compiler.set_stance('force_eager')) so that the norm hooks see every call, and the "
            "other steps run the compiled code, which runs no hook added after it compiled: there the "
            "findings read the ladder's growth on the measured steps only, not every step.")


def decoder_padding_message(name: str) -> str:
    return (f"{name}: the batch marks the encoder's padding (attention_mask) but not the decoder's (no "
            "decoder_attention_mask): the decoder's norms count every row, padding included. Pass "
            "decoder_attention_mask, or row_mask=. Said once.")


def row_mask_message(name: str, err: BaseException) -> str:
    return (f"{name}: the row mask failed ({type(err).__name__}: {err}); every row is measured from now on "
            "(training goes on).")
