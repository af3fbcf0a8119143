"""Chat / preference fixture data for the sft and dpo tests (shared by conftest and the tests)."""

import json
import random

WORDS = (
    "the union state people congress nation government year war peace law work children future "
    "america world economy freedom trade tax health security jobs energy history hope country we our"
).split()

# A minimal chat template for the tiny tokenizer (which has none): role headers, and the EOS
# token as end-of-turn, so an assistant turn's tokens are its content plus "<|endoftext|>\n".
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
END_OF_TURN = "<|endoftext|>\n"


def _sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_chat_data(root, n=12, seed=0):
    """A dozen examples per format: messages (some multi-turn, some with a system turn),
    prompt/completion (and prompt/response), preference with strings and with whole conversations
    (the ultrafeedback_binarized shape)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    messages, completions, preferences, conversations = [], [], [], []
    for i in range(n):
        turns = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            turns += [
                {"role": "user", "content": _sentence(rng, 3)},
                {"role": "assistant", "content": _sentence(rng, 4)},
            ]
        messages.append({"messages": turns})
        reply = "completion" if i % 2 else "response"
        completions.append({"prompt": _sentence(rng, 3), reply: _sentence(rng, 5)})
        prompt, chosen, rejected = _sentence(rng, 3), _sentence(rng, 4), _sentence(rng, 6)
        preferences.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        user = {"role": "user", "content": prompt}
        conversations.append(
            {
                "prompt": prompt,
                "chosen": [user, {"role": "assistant", "content": chosen}],
                "rejected": [user, {"role": "assistant", "content": rejected}],
                "score_chosen": 8.0,
            }
        )
    return {
        "messages": _write_jsonl(root / "messages.jsonl", messages),
        "prompt_completion": _write_jsonl(root / "prompt_completion.jsonl", completions),
        "preference": _write_jsonl(root / "preference.jsonl", preferences),
        "preference_conversations": _write_jsonl(root / "preference_conversations.jsonl", conversations),
    }
