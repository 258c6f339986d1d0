"""Extract structured data: the output is constrained to a pydantic model's JSON schema.

Run: python examples/json_extraction.py
"""

from pydantic import BaseModel, Field

import braid


class City(BaseModel):
    name: str = Field(max_length=32)
    country: str = Field(max_length=32)
    population_millions: float = Field(ge=0)


@braid.function
def extract(s, passage):
    s += braid.system("Extract the city described in the passage as JSON.")
    s += braid.user(passage)
    s += braid.assistant(braid.gen("city", max_tokens=96, json_schema=City))


def main():
    runtime = braid.Runtime(model_path="smollm2")
    try:
        state = extract.run(passage="Paris, the capital of France, has about 2.1 million inhabitants.",
                            backend=runtime, temperature=0)
        city = City.model_validate_json(state["city"])
        print(repr(city))
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
