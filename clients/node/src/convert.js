// Conversions between plain JavaScript values and the tokensvc.v1 messages as @grpc/proto-loader
// represents them (camelCase fields, enums as names, 64-bit integers as strings, oneofs named).

const FILTER_OPERATORS = new Set(['EQ', 'NE', 'IN', 'NIN', 'GT', 'GTE', 'LT', 'LTE', 'EXISTS']);

/** A JavaScript string, number or boolean as a tokensvc.v1.MetadataValue. */
export function toMetadataValue(value) {
  switch (typeof value) {
    case 'string':
      return { stringValue: value };
    case 'number':
      return { numberValue: value };
    case 'boolean':
      return { boolValue: value };
    default:
      if (value !== null && typeof value === 'object' && ('stringValue' in value || 'numberValue' in value || 'boolValue' in value)) {
        return value; // already a MetadataValue
      }
      throw new TypeError(`metadata values must be strings, numbers or booleans, got ${value === null ? 'null' : typeof value}`);
  }
}

/** A tokensvc.v1.MetadataValue as the JavaScript value it holds. */
export function fromMetadataValue(value) {
  if (value === null || value === undefined || !value.kind) {
    return null;
  }
  return value[value.kind];
}

export function toMetadataMap(metadata) {
  if (metadata === undefined || metadata === null) {
    return {};
  }
  return Object.fromEntries(Object.entries(metadata).map(([key, value]) => [key, toMetadataValue(value)]));
}

export function fromMetadataMap(metadata) {
  return Object.fromEntries(Object.entries(metadata ?? {}).map(([key, value]) => [key, fromMetadataValue(value)]));
}

/** Seconds (a number, fractions allowed) as a google.protobuf.Duration; undefined stays unset. */
export function toDuration(seconds) {
  if (seconds === undefined || seconds === null) {
    return null;
  }
  if (typeof seconds !== 'number' || !Number.isFinite(seconds)) {
    throw new TypeError('a duration must be a finite number of seconds');
  }
  const whole = Math.trunc(seconds);
  return { seconds: String(whole), nanos: Math.round((seconds - whole) * 1e9) };
}

/** A google.protobuf.Duration as seconds, or null when unset. */
export function fromDuration(duration) {
  if (!duration) {
    return null;
  }
  return Number(duration.seconds) + (duration.nanos ?? 0) / 1e9;
}

/** A google.protobuf.Timestamp as a Date, or null when unset. */
export function fromTimestamp(timestamp) {
  if (!timestamp) {
    return null;
  }
  return new Date(Number(timestamp.seconds) * 1000 + Math.floor((timestamp.nanos ?? 0) / 1e6));
}

/**
 * A filter as a tokensvc.v1.Filter. Accepts the shorthand
 * `{key, op, value}` / `{key, op: 'IN', values}` / `{and: [...]}` / `{or: [...]}` / `{not: f}`,
 * with plain JavaScript values, or a Filter message already in proto-loader form.
 */
export function toFilter(filter) {
  if (filter === undefined || filter === null) {
    return null;
  }
  if ('and' in filter) {
    return { andFilters: { filters: filter.and.map(toFilter) } };
  }
  if ('or' in filter) {
    return { orFilters: { filters: filter.or.map(toFilter) } };
  }
  if ('not' in filter) {
    return { notFilter: toFilter(filter.not) };
  }
  if ('key' in filter) {
    const op = String(filter.op ?? filter.operator ?? '').replace(/^FILTER_OPERATOR_/, '').toUpperCase();
    if (!FILTER_OPERATORS.has(op)) {
      throw new TypeError(`unknown filter operator ${JSON.stringify(filter.op ?? filter.operator)}`);
    }
    const field = { key: filter.key, operator: `FILTER_OPERATOR_${op}` };
    if (filter.value !== undefined) {
      field.value = toMetadataValue(filter.value);
    }
    if (filter.values !== undefined) {
      field.values = filter.values.map(toMetadataValue);
    }
    return { field };
  }
  return filter; // a Filter message (field / andFilters / orFilters / notFilter)
}

export function fromMemory(memory) {
  if (!memory) {
    return null;
  }
  return {
    id: memory.id,
    content: memory.content,
    metadata: fromMetadataMap(memory.metadata),
    createdAt: fromTimestamp(memory.createdAt),
    updatedAt: fromTimestamp(memory.updatedAt),
    expiresAt: fromTimestamp(memory.expiresAt),
    embedder: memory.embedder,
  };
}

export function fromScope(scope) {
  return {
    namespace: scope.namespace,
    agent: scope.agent,
    bucketId: scope.bucketId,
    perUser: scope.perUser,
    registry: scope.registry,
    longTermMemory: scope.longTermMemory,
    knowledgeBases: [...scope.knowledgeBases],
    runId: scope.runId,
    jti: scope.jti,
    issuedAt: fromTimestamp(scope.issuedAt),
    expiresAt: fromTimestamp(scope.expiresAt),
  };
}

const SESSION_SCOPES = { session: 'SESSION_SCOPE_SESSION', shared: 'SESSION_SCOPE_SHARED' };

export function toSessionScope(scope) {
  if (scope === undefined || scope === null) {
    return 'SESSION_SCOPE_UNSPECIFIED';
  }
  const value = SESSION_SCOPES[String(scope).toLowerCase()];
  if (value === undefined) {
    throw new TypeError(`scope must be 'session' or 'shared', got ${JSON.stringify(scope)}`);
  }
  return value;
}

export function fromSessionScope(scope) {
  return String(scope).replace(/^SESSION_SCOPE_/, '').toLowerCase();
}

const SEARCH_MODES = {
  vector: 'SEARCH_MODE_VECTOR',
  hybrid: 'SEARCH_MODE_HYBRID',
  text: 'SEARCH_MODE_TEXT',
};

export function toSearchMode(mode) {
  if (mode === undefined || mode === null) {
    return 'SEARCH_MODE_UNSPECIFIED';
  }
  const value = SEARCH_MODES[String(mode).toLowerCase()];
  if (value === undefined) {
    throw new TypeError(`mode must be 'vector', 'hybrid' or 'text', got ${JSON.stringify(mode)}`);
  }
  return value;
}
