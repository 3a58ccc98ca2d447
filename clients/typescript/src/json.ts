/**
 * JSON with exact 64-bit integers. `fencingToken` is a JSON number that can
 * exceed 2^53 (tokens are below 2^63), and `JSON.parse` would silently round
 * it to the nearest double; two different tokens could then compare equal,
 * which defeats fencing. Node 20's `JSON.parse` reviver cannot see a
 * number's source text, so this module has a small strict JSON parser that
 * turns every integer literal under a chosen key into a `bigint` from its
 * digits, and a serialiser that writes `bigint`s as plain JSON numbers.
 * A leaf: imports nothing of the package.
 */

export type Json = null | boolean | number | bigint | string | Json[] | { [key: string]: Json };

/** Thrown for text that is not JSON (the transport reports it as a malformed answer). */
export class JsonSyntaxError extends SyntaxError {
  override name = "JsonSyntaxError";
}

/**
 * Parses `text` as JSON; numbers under a key in `exactKeys` must be integers
 * and become `bigint`s (any depth, e.g. `results[i].fencingToken`). Other
 * numbers are ordinary `number`s.
 */
export function parseJson(text: string, exactKeys: ReadonlySet<string> = new Set(["fencingToken"])): Json {
  const p = new Parser(text, exactKeys);
  p.ws();
  const value = p.value(undefined);
  p.ws();
  if (p.i !== text.length) p.fail("trailing characters");
  return value;
}

/** Serialises `value` as JSON, writing `bigint`s as exact JSON numbers. */
export function stringifyJson(value: Json): string {
  if (typeof value === "bigint") return value.toString();
  if (value === null || typeof value !== "object") {
    const s = JSON.stringify(value);
    if (s === undefined) throw new TypeError(`not JSON: ${String(value)}`);
    return s;
  }
  if (Array.isArray(value)) return `[${value.map(stringifyJson).join(",")}]`;
  const parts: string[] = [];
  for (const [k, v] of Object.entries(value)) {
    if (v !== undefined) parts.push(`${JSON.stringify(k)}:${stringifyJson(v)}`);
  }
  return `{${parts.join(",")}}`;
}

const NUMBER = /-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?/y;
const INTEGER = /^-?(?:0|[1-9]\d*)$/;

class Parser {
  i = 0;

  constructor(
    readonly text: string,
    readonly exactKeys: ReadonlySet<string>,
  ) {}

  fail(what: string): never {
    throw new JsonSyntaxError(`invalid JSON at offset ${this.i}: ${what}`);
  }

  ws(): void {
    while (this.i < this.text.length && " \t\n\r".includes(this.text[this.i]!)) this.i++;
  }

  /** One value; `key` is the object key it sits under, if any. */
  value(key: string | undefined): Json {
    const c = this.text[this.i];
    if (c === "{") return this.object();
    if (c === "[") return this.array(key);
    if (c === '"') return this.string();
    if (c === "-" || (c !== undefined && c >= "0" && c <= "9")) return this.number(key);
    for (const [word, v] of [
      ["true", true],
      ["false", false],
      ["null", null],
    ] as const) {
      if (this.text.startsWith(word, this.i)) {
        this.i += word.length;
        return v;
      }
    }
    return this.fail("expected a value");
  }

  object(): Json {
    const out: { [key: string]: Json } = {};
    this.i++;
    this.ws();
    if (this.text[this.i] === "}") {
      this.i++;
      return out;
    }
    for (;;) {
      this.ws();
      if (this.text[this.i] !== '"') this.fail("expected a key");
      const k = this.string();
      this.ws();
      if (this.text[this.i] !== ":") this.fail("expected ':'");
      this.i++;
      this.ws();
      // defineProperty: a "__proto__" key is data, not a prototype change.
      Object.defineProperty(out, k, { value: this.value(k), enumerable: true, writable: true, configurable: true });
      this.ws();
      const c = this.text[this.i++];
      if (c === "}") return out;
      if (c !== ",") this.fail("expected ',' or '}'");
    }
  }

  /** Array items inherit the array's key, so `"tokens": [1, 2]` is exact too. */
  array(key: string | undefined): Json {
    const out: Json[] = [];
    this.i++;
    this.ws();
    if (this.text[this.i] === "]") {
      this.i++;
      return out;
    }
    for (;;) {
      this.ws();
      out.push(this.value(key));
      this.ws();
      const c = this.text[this.i++];
      if (c === "]") return out;
      if (c !== ",") this.fail("expected ',' or ']'");
    }
  }

  string(): string {
    const start = this.i;
    this.i++;
    for (;;) {
      const c = this.text[this.i];
      if (c === undefined) this.fail("unterminated string");
      if (c === "\\") this.i += 2;
      else if (c === '"') break;
      else this.i++;
    }
    this.i++;
    try {
      // The built-in parser decodes escapes and rejects raw control characters.
      return JSON.parse(this.text.slice(start, this.i)) as string;
    } catch {
      this.i = start;
      return this.fail("bad string");
    }
  }

  number(key: string | undefined): number | bigint {
    NUMBER.lastIndex = this.i;
    const m = NUMBER.exec(this.text);
    if (!m) return this.fail("bad number");
    this.i += m[0].length;
    if (key !== undefined && this.exactKeys.has(key)) {
      if (!INTEGER.test(m[0])) {
        this.i -= m[0].length;
        this.fail(`${key} must be an integer`);
      }
      return BigInt(m[0]);
    }
    return Number(m[0]);
  }
}
