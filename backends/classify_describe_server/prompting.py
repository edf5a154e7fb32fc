"""Prompt building, and the description composed from the classification
alone when no LLM answer can be used."""


class PromptError(ValueError):
    """The caller's PROMPT or LABELS are refused (the adapter answers INVALID_ARG)."""

    def __init__(self, message, field):
        super().__init__(message)
        self.field = field  # the input at fault: PROMPT or LABELS


def read_prompt(raw, max_chars):
    """The caller's PROMPT as text, stripped; "" when absent. Refuses bytes that
    are not UTF-8 (never guess what a caller meant, never forward U+FFFD to a
    paid model) and text longer than `max_chars` (input tokens cost money)."""
    if raw is None:
        return ""
    text = _utf8(raw, "PROMPT", "PROMPT").strip()
    if len(text) > max_chars:
        raise PromptError(f"PROMPT has {len(text)} characters, more than the limit "
                          f"max_prompt_chars={max_chars} (model config)", "PROMPT")
    return text


def read_labels(raw, settings):
    """One batch row of LABELS as text. A client may call describe directly with
    LABELS of its own, and they go into the paid prompt like PROMPT does: at
    most max_labels of them, each at most max_label_chars, all together at
    most max_prompt_chars, UTF-8 only."""
    if len(raw) > settings.max_labels:
        raise PromptError(f"LABELS has {len(raw)} labels, more than the limit "
                          f"max_labels={settings.max_labels} (model config)", "LABELS")
    labels = tuple(_utf8(value, f"LABELS[{i}]", "LABELS") for i, value in enumerate(raw))
    for i, label in enumerate(labels):
        if len(label) > settings.max_label_chars:
            raise PromptError(f"LABELS[{i}] has {len(label)} characters, more than the limit "
                              f"max_label_chars={settings.max_label_chars} (model config)", "LABELS")
    total = sum(len(label) for label in labels)
    if total > settings.max_prompt_chars:
        raise PromptError(f"LABELS have {total} characters together, more than the limit "
                          f"max_prompt_chars={settings.max_prompt_chars} (model config)", "LABELS")
    return labels


def _utf8(raw, name, field):
    if not isinstance(raw, (bytes, bytearray)):
        return str(raw)
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"{name} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset "
                          f"{exc.start}); send it encoded as UTF-8", field) from None


def short_label(label):
    # ImageNet-style labels list synonyms ("tabby, tabby cat"); the first reads best.
    return label.split(",")[0].strip() or label.strip()


def format_labels(labels, scores):
    return "\n".join(f"- {label} ({score:.1%})" for label, score in zip(labels, scores))


def build_messages(settings, labels, scores, prompt, image_url=None, conversation=()):
    """The chat messages sent upstream: the project's system prompt first, then
    the client's own system messages and earlier turns, then the question with
    the labels as grounding and, with `image_url`, the photo as an image part.
    Labels are ranked by score first so the template's {top_label} and the
    list order never depend on the caller."""
    ranked = sorted(zip(labels, scores), key=lambda pair: -pair[1])
    labels = [label for label, _ in ranked]
    scores = [score for _, score in ranked]
    user = settings.prompt_template.format(
        prompt=prompt, labels=format_labels(labels, scores), top_label=labels[0])
    if image_url is not None:
        user = [{"type": "text", "text": user},
                {"type": "image_url", "image_url": {"url": image_url, "detail": settings.vision_detail}}]
    return [
        {"role": "system", "content": settings.system_prompt},
        *({"role": role, "content": content} for role, content in conversation),
        {"role": "user", "content": user},
    ]


def fallback_description(labels, scores):
    """A plain sentence from the classification, e.g. 'Most likely a tabby
    (62%); it could also be a tiger cat (21%) or an Egyptian cat (9%).'"""
    ranked = sorted(zip(labels, scores), key=lambda pair: -pair[1])
    top, top_score = ranked[0]
    text = f"Most likely {_article(short_label(top))} ({top_score:.0%})"
    others = [f"{_article(short_label(label))} ({score:.0%})" for label, score in ranked[1:3]]
    if others:
        text += "; it could also be " + " or ".join(others)
    return text + "."


def _article(noun):
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun
