"""Training data for a draft head: the target's own answers, and what the target saw and
thought at every position of them.

    prompts    the shipped prompt set's calibration part (calibration/dataset.py split: the
               held-out part stays out, it measures acceptance), plus prompts written from
               templates over ~120 topics, code tasks and arithmetic (template_prompts)
    answers    the engine folder's own greedy and seeded sampled answers (open_batch: the same
               engine the head will draft for), as token ids
    teacher    one torch forward of the target per sequence (its Hugging Face model, the
               export's reference): the tapped layers' hidden states, the last hidden state
               after the final norm (Medusa's input) and the target's top-K next-token
               log-probabilities, fp16, one .npz shard per batch of sequences

Every stage writes its file once and skips work already on disk (resumable); seeded.
"""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Sequence

import numpy as np

log = logging.getLogger(__name__)

TOPICS = (
    "the ocean", "volcanoes", "the human heart", "photosynthesis", "the stock market", "saving money",
    "learning to cook", "baking bread", "running a marathon", "sleep", "coffee", "tea", "dogs", "cats",
    "birds", "bees", "climate change", "recycling", "solar power", "electric cars", "trains", "airplanes",
    "the moon", "Mars", "black holes", "gravity", "magnets", "electricity", "the internet", "email",
    "passwords", "Python programming", "JavaScript", "databases", "spreadsheets", "sorting algorithms",
    "recursion", "machine learning", "chess", "football", "basketball", "the piano", "painting",
    "poetry", "novels", "Shakespeare", "ancient Rome", "ancient Egypt", "the printing press",
    "the French Revolution", "World War II", "democracy", "taxes", "job interviews", "resumes",
    "public speaking", "time management", "friendship", "parenting", "gardening", "houseplants",
    "tomatoes", "apples", "rice", "chocolate", "vitamins", "exercise", "yoga", "meditation", "stress",
    "the immune system", "vaccines", "bacteria", "DNA", "evolution", "dinosaurs", "forests", "deserts",
    "rivers", "mountains", "weather", "rainbows", "snow", "earthquakes", "maps", "languages",
    "grammar", "writing an essay", "fractions", "percentages", "prime numbers", "geometry",
    "probability", "statistics", "budgets", "renting an apartment", "moving to a new city",
    "travel packing", "camping", "photography", "music theory", "movies", "video games", "robots",
    "3D printing", "smartphones", "batteries", "water", "salt", "glass", "paper", "bridges",
    "skyscrapers", "volunteering", "customer service", "negotiation", "small business", "marketing",
)

TEMPLATES = (
    "Why is {t} important?", "Explain {t} to a ten-year-old.", "Give me three tips about {t}.",
    "Write a short poem about {t}.", "What are common misconceptions about {t}?",
    "Summarize what people should know about {t} in one paragraph.", "List five facts about {t}.",
    "How would you describe {t} to someone who has never heard of it?",
    "Write a short story that involves {t}.", "What questions should a beginner ask about {t}?",
)

CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a sentence",
    "returns the largest item of a list", "merges two sorted lists", "computes a factorial",
    "removes duplicates from a list", "checks whether a word is a palindrome", "sums the digits of a number",
    "converts Celsius to Fahrenheit", "finds the average of a list of numbers", "reads a file line by line",
    "counts how often each letter appears", "returns the Fibonacci numbers below n", "flattens a nested list",
)


def template_prompts(seed: int) -> list[str]:
    """Prompts written from templates (TEMPLATES x TOPICS, code tasks in three languages, small
    arithmetic word problems), shuffled with `seed`: varied requests whose answers (the model's
    own) are the training data. The held-out prompts come from the shipped set, not from here."""
    rng = random.Random(seed)
    out = [tpl.format(t=t) for t in TOPICS for tpl in TEMPLATES]
    out += [f"Write a {lang} function that {task}." for task in CODE_TASKS for lang in ("Python", "JavaScript", "C")]
    for _ in range(60):
        a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 9)
        out.append(rng.choice([f"A shop sells {a} apples a day for {b} days. How many apples is that?",
                               f"What is {a} plus {b} times {c}? Show your steps.",
                               f"If a train travels {a} km in {c} hours, what is its average speed?",
                               f"Tom has {a} marbles and gives away {b}. How many are left?"]))
    rng.shuffle(out)
    return out


def answer(folder: str | Path, prompts: Sequence[str], out: Path, *, samples: Sequence[float], seed: int,
           max_new_tokens: int, max_num_seqs: int = 8) -> list[dict]:
    """The folder's answers to every prompt at every temperature in `samples` (0: greedy), as
    {"prompt": ids, "answer": ids, "temperature": t}; written to `out` (jsonl), read back when
    it is there."""
    if out.exists():
        return [json.loads(line) for line in out.read_text().splitlines()]
    from tqdm import tqdm

    from specrt.runtime import SamplingParams, open_batch
    from specrt.runtime.prompt import encode_prompt
    with open_batch(folder, max_num_seqs=max_num_seqs) as gen:
        chat = gen.tokenizer.has_chat_template          # (a tiny test model has none: plain prompts)
        ids = [encode_prompt(gen.tokenizer, p, chat=chat) for p in prompts]
        room = gen.engine.max_context - max_new_tokens
        long = sum(len(p) > room for p in ids)
        if long:
            log.warning("answers: %d of %d prompts are longer than %d tokens (the folder's maximum context less "
                        "max_new_tokens): skipped", long, len(ids), room)
            ids = [p for p in ids if len(p) <= room]
        jobs = [(p, t) for p in ids for t in samples]
        handles = [gen.submit(p, max_new_tokens=max_new_tokens,
                              sampling=SamplingParams(temperature=t, seed=seed + i) if t else None)
                   for i, (p, t) in enumerate(jobs)]
        rows = []
        for (p, t), h in tqdm(list(zip(jobs, handles)), desc="answers", unit="answer"):
            rows.append({"prompt": list(p), "answer": list(h.result().tokens), "temperature": t})
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out)
    return rows


def teacher_shard(model, seqs: Sequence[dict], layers: Sequence[int], top_k: int) -> dict:
    """One torch forward over `seqs` (each prompt + answer): tapped layers [N, L, n*h], the last
    hidden state after the final norm [N, L, h], the target's top_k log-probabilities and ids
    [N, L, top_k] at every position (fp16 / int32), tokens [N, L] and each row's prompt and total
    length. Padding on the right (never attended by a real position: causal)."""
    import torch
    L = max(len(s["prompt"]) + len(s["answer"]) for s in seqs)
    tokens = np.zeros((len(seqs), L), np.int64)
    lengths = np.zeros(len(seqs), np.int64)
    prompt_len = np.zeros(len(seqs), np.int64)
    for i, s in enumerate(seqs):
        ids = s["prompt"] + s["answer"]
        tokens[i, :len(ids)] = ids
        lengths[i], prompt_len[i] = len(ids), len(s["prompt"])
    with torch.no_grad():
        out = model(torch.from_numpy(tokens), output_hidden_states=True)
        hs = out.hidden_states      # [embeddings, layer 0 out, ..., normed last]
        feats = torch.cat([hs[i + 1] for i in layers], -1)
        lp = torch.log_softmax(out.logits.float(), -1)
        top = lp.topk(top_k, -1)
    return {"tokens": tokens.astype(np.int32), "lengths": lengths, "prompt_len": prompt_len,
            "feats": feats.numpy().astype(np.float16), "last": hs[-1].numpy().astype(np.float16),
            "top_lp": top.values.numpy().astype(np.float16), "top_id": top.indices.numpy().astype(np.int32)}


def teacher(model, rows: Sequence[dict], out_dir: Path, layers: Sequence[int], *, top_k: int = 32,
            batch: int = 8) -> list[Path]:
    """teacher_shard over `rows` sorted by length, `batch` sequences a shard; shards already on
    disk are kept (resumable)."""
    from tqdm import tqdm
    out_dir.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt"]) + len(rows[i]["answer"]))
    paths = []
    for n, start in enumerate(tqdm(range(0, len(order), batch), desc="teacher", unit="shard")):
        path = out_dir / f"shard-{n:05d}.npz"
        paths.append(path)
        if path.exists():
            continue
        shard = teacher_shard(model, [rows[i] for i in order[start:start + batch]], layers, top_k)
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, **shard)
        tmp.replace(path)
    return paths
