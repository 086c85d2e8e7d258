"""A small text-to-SQL task in SkyRL-SQL's row layout, for skyrl-gym's `text2sql` environment
unchanged: a sqlite database at <db_path>/spider/database/<db_id>/<db_id>.sqlite and parquet rows
with `prompt` (chat messages), `env_class`, `reward_spec` (the gold SQL), `db_id`, `data` and
`extra_info` columns -- the columns SkyRL's PromptDataset hands the environment as extras."""

from __future__ import annotations

import sqlite3
from pathlib import Path

DB_ID = "concert_singer"
SINGERS = [
    ("Joe Sharp", "Netherlands", 52),
    ("Timbaland", "United States", 32),
    ("Justin Brown", "France", 29),
    ("Rose White", "France", 41),
    ("John Nizinik", "France", 43),
    ("Tribal King", "France", 25),
]
# SkyRL-SQL's instructions, shortened: think, query with <sql>, read the result, answer with <solution>
# (the environment's verifier wants a <think> block before the solution).
SYSTEM = (
    "You are a data science expert. Answer the question by writing SQLite queries against the database. "
    "Think inside <think>...</think>, then write one query inside <sql>...</sql> to look at the data; its "
    "result comes back to you. When you know the answer, think once more and write the final query "
    "inside <solution>...</solution>."
)
SCHEMA = "CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER)"
QUESTIONS = [
    ("How many singers are there?", "SELECT count(*) FROM singer"),
    ("What is the average age of singers from France?", "SELECT avg(age) FROM singer WHERE country = 'France'"),
    ("List the names of singers older than 40.", "SELECT name FROM singer WHERE age > 40"),
    (
        "Which country has the most singers?",
        "SELECT country FROM singer GROUP BY country ORDER BY count(*) DESC LIMIT 1",
    ),
    ("What is the name of the youngest singer?", "SELECT name FROM singer ORDER BY age ASC LIMIT 1"),
    ("How many distinct countries do singers come from?", "SELECT count(DISTINCT country) FROM singer"),
    ("What is the maximum age of all singers?", "SELECT max(age) FROM singer"),
    ("List every singer's name and country.", "SELECT name, country FROM singer"),
]


def make_text2sql(root: Path, max_turns: int = 3) -> tuple[str, str]:
    """(the parquet file, env.env_config.db_path) of the task under `root`."""
    import pandas as pd

    db_path = root / "sql_data"
    db_file = db_path / "spider" / "database" / DB_ID / f"{DB_ID}.sqlite"
    db_file.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(db_file) as conn:
        conn.execute(SCHEMA)
        conn.executemany("INSERT INTO singer (name, country, age) VALUES (?, ?, ?)", SINGERS)
    rows = [
        {
            "data_source": "synthetic_spider",
            "prompt": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Database schema:\n{SCHEMA}\n\nQuestion: {question}"},
            ],
            "env_class": "text2sql",
            "reward_spec": {"method": "rule", "ground_truth": gold},
            "db_id": DB_ID,
            "data": "spider",
            "max_turns": max_turns,  # skyrl-gym's SQLEnv reads it from extras
            "extra_info": {"index": i},
        }
        for i, (question, gold) in enumerate(QUESTIONS)
    ]
    out = root / "text2sql.parquet"
    pd.DataFrame(rows).to_parquet(out)
    return str(out), str(db_path)
