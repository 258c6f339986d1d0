"""The program the browser tests trace: run_batch over two topics, each forking two branches, a select and a
JSON-schema-constrained gen."""

from pydantic import BaseModel

import braid


class City(BaseModel):
    name: str
    country: str


@braid.function
def plan(s, topic):
    s += braid.system("You are a concise travel assistant.")
    s += braid.user(f"Name one city famous for {topic}.")
    forks = s.fork(2)
    forks += lambda i: braid.assistant(("In short: ", "In detail: ")[i] + braid.gen("note", max_tokens=16, stop="\n"))
    forks.join()
    s += braid.user("Is it worth visiting?")
    s += braid.assistant(braid.select("verdict", choices=["yes", "no"]))
    s += braid.user("Give that city as JSON.")
    s += braid.assistant(braid.gen("city", max_tokens=64, json_schema=City))


TOPICS = [{"topic": "canals"}, {"topic": "museums"}]
