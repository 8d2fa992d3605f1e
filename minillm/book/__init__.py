"""The course book: ``minillm book --out DIR`` builds a static site of the lessons as executed."""
