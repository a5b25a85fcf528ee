"""prompt.py — how a problem is asked: the system turn and the token ids of a prompt (rollouts, evaluation, the
refiner's question, the toy world's warm start all build theirs here)."""

DEFAULT_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."   # the system turn


def format_prompt(tokenizer, question: str, system: str | None = DEFAULT_SYSTEM) -> list[int]:
    """Token ids of the prompt for `question`.

    With a chat template: [system?, user=question] and the assistant header (add_generation_prompt).
    Without one: the plain text "Question: {question}\\nSolution:\\n" (the system line is not used).
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": question})
        # transformers 5: tokenize=True returns a dict, so render the text and encode it ourselves
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = f"Question: {question}\nSolution:\n"
    return tokenizer.encode(text, add_special_tokens=False)
