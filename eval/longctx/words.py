"""Word lists and random needle values (keys, values, coded words), all drawn from a passed-in RNG.

RULER draws keys as adjective-noun pairs from large word lists; a few hundred common words give
~30k distinct pairs, plenty for a few needles per sample, with no download.
"""

from __future__ import annotations

import random
import string
import uuid

ADJECTIVES = """
able acid aged airy ample angry ashen awake bald bare basic bent bitter black bland blank blue bold
bony brave brief bright brisk broad brown busy calm cheap chief chilly civil clean clear clever close
cold cool coral crisp cruel curly cute damp dark deep dense dirty dizzy dry dull dusty eager early
easy empty equal even exact faint fair false fancy fast fierce final firm flat fond foggy formal frail
free fresh full funny fuzzy gentle giant glad glossy golden grand gray great green grim gross happy
hard harsh heavy hidden high hollow honest huge humble hungry icy idle inner jolly juicy keen kind
large late lazy lean legal light little live lonely long loose loud lovely low loyal lucky lush mad
major mellow mild minor misty modern moist narrow neat new nice noble noisy odd old open orange outer
pale plain plump polite poor prime proud pure purple quick quiet rapid rare raw ready real red rich
rigid ripe rough round royal rude rusty sad safe salty sandy sharp shiny short shy silent silky silver
simple slim slow small smart smooth soft solid sour spare spicy stale steady steep stiff still stout
strong sunny super sweet swift tall tame tender thick thin tidy tiny tough true ugly upper urban vague
vast vivid warm weak wet white whole wide wild windy wise witty wooden young
""".split()

NOUNS = """
acorn actor anchor angle ankle apple apron arch arrow attic badge bakery ballad banjo barn basket
beach beacon bean beard bell bench berry bicycle blanket blossom boat bonnet book bottle boulder bowl
branch bread brick bridge brook broom bucket bugle butter button cabin cable camel candle canoe canyon
carpet carrot castle cellar chair chalk channel cherry chimney cider circle clock cloud clover coat
comet compass cookie copper cottage cradle crane crayon creek crown cup curtain cushion daisy desert
diamond dolphin donkey door dragon drum eagle easel elbow engine falcon feather fence fern ferry fiddle
field flag flute forest fountain fox garden garlic gate geyser glacier glove goat harbor harp hat
hedge helmet hill hinge honey horizon horse island ivory jacket jelly jewel kettle key kite ladder
lagoon lake lamp lantern lemon lens letter lily lizard locket lobster magnet mango maple marble meadow
mirror mitten monkey moon mountain mural needle nest nutmeg oasis ocean olive onion orchard otter owl
paddle palace panda parrot pearl pebble pencil pepper piano pillow planet plum pocket pond poppy puzzle
quilt rabbit radio raven ribbon river robin rocket saddle sail salmon satchel scarf shadow shell ship
shovel signal silo sled slipper spoon spring stable statue stone stream sunflower swan table teapot
temple thimble thistle tiger timber tower trail trumpet tulip tunnel turtle umbrella valley vase
violin wagon walnut walrus whistle willow window wizard wolf yacht zebra
""".split()


def random_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def random_number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def random_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_var_name(rng: random.Random, k: int = 5) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=k))


def random_coded_word(rng: random.Random, k: int = 6) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=k))


VALUE_KINDS = {"numbers": random_number, "uuids": random_uuid, "words": random_key}


def random_value(kind: str, rng: random.Random) -> str:
    if kind not in VALUE_KINDS:
        raise ValueError(f"unknown needle value kind {kind!r}; allowed: {', '.join(VALUE_KINDS)}")
    return VALUE_KINDS[kind](rng)


def distinct(draw, n: int, rng: random.Random, exclude: set[str] | None = None) -> list[str]:
    """n distinct draws of `draw(rng)`, none in `exclude` (bounded retries so a tiny pool fails loudly)."""
    seen = set(exclude or ())
    out: list[str] = []
    for _ in range(200 * n + 200):
        if len(out) == n:
            break
        v = draw(rng)
        if v not in seen:
            seen.add(v)
            out.append(v)
    if len(out) != n:
        raise ValueError(
            f"could not draw {n} distinct values with {getattr(draw, '__name__', draw)}"
        )
    return out
