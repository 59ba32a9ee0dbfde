"""A user's reward: partial credit for the answer's digits, full credit for the answer."""


def reward(*, response, record, finish_reason):
    answer = str(record["answer"])
    if response.strip() == answer and finish_reason == "stop":
        return 1.0
    hits = sum(1 for ch in answer if ch in response)
    return 0.5 * hits / len(answer)
