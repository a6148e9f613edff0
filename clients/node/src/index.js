// tokensvc client for Node.js: mutually authenticated TLS gRPC with the run capability attached
// to every call, default deadlines, plain-object results and typed errors.
//
// The service definitions are loaded at runtime from the repository's protos/ directory (the one
// contract every client is generated from); nothing is copied or pre-generated.

import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';

import {
  fromDuration,
  fromMemory,
  fromScope,
  fromSessionScope,
  toDuration,
  toFilter,
  toMetadataMap,
  toSearchMode,
  toSessionScope,
} from './convert.js';
import { fromServiceError, TokensvcError } from './errors.js';

export { decodeStatus, ERROR_DOMAIN, TokensvcError } from './errors.js';

/** The repository's protos/ directory (clients/node/src -> ../../../protos). */
export const DEFAULT_PROTOS_DIR = fileURLToPath(new URL('../../../protos/', import.meta.url));

/** The deadline of every call unless the client or the call sets another one. */
export const DEFAULT_DEADLINE_MS = 10_000;

const PROTO_FILES = ['tokensvc/v1/capability.proto', 'tokensvc/v1/memory.proto'];
const LOADER_OPTIONS = {
  keepCase: false, // camelCase field names
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
};

const packages = new Map();

/** Load (once per directory) the tokensvc.v1 services from the .proto files under `protosDir`. */
export function loadServices(protosDir = DEFAULT_PROTOS_DIR) {
  let services = packages.get(protosDir);
  if (services === undefined) {
    const definition = protoLoader.loadSync(PROTO_FILES, { ...LOADER_OPTIONS, includeDirs: [protosDir] });
    const v1 = grpc.loadPackageDefinition(definition).tokensvc.v1;
    services = { CapabilityService: v1.CapabilityService, MemoryService: v1.MemoryService };
    packages.set(protosDir, services);
  }
  return services;
}

function readPem(value, name) {
  if (value === undefined || value === null) {
    throw new TypeError(`${name} is required (mTLS only)`);
  }
  return Buffer.isBuffer(value) ? value : readFileSync(value);
}

/**
 * Create a tokensvc client for a launcher.
 *
 * @param {object} options
 * @param {string} [options.target] host:port of tokensvc (default `127.0.0.1:50051`)
 * @param {string} [options.caFile] CA bundle (PEM) the server certificate must chain to
 * @param {string} [options.certFile] this launcher's client certificate chain (PEM)
 * @param {string} [options.keyFile] this launcher's private key (PEM)
 * @param {Buffer} [options.ca] / [options.cert] / [options.key] the same as bytes, instead of files
 * @param {string | (() => string | Promise<string>)} options.capability the run capability (compact
 *   JWS), or a function returning the current one; sent as `authorization: Bearer ...` on every call
 * @param {number} [options.deadlineMs] default deadline of every call (10 s)
 * @param {string} [options.serverName] TLS server name to verify instead of the target's host
 * @param {string} [options.protosDir] where the tokensvc .proto files are (the repository's protos/)
 * @param {object} [options.channelOptions] extra @grpc/grpc-js channel options
 */
export function createClient(options) {
  return new TokensvcClient(options);
}

export class TokensvcClient {
  constructor({
    target = '127.0.0.1:50051',
    caFile,
    certFile,
    keyFile,
    ca,
    cert,
    key,
    capability,
    deadlineMs = DEFAULT_DEADLINE_MS,
    serverName,
    protosDir = DEFAULT_PROTOS_DIR,
    channelOptions = {},
  } = {}) {
    if (typeof capability !== 'string' && typeof capability !== 'function') {
      throw new TypeError('capability is required: the run capability (a compact JWS) or a function returning it');
    }
    const credentials = grpc.credentials.createSsl(
      readPem(ca ?? caFile, 'caFile'),
      readPem(key ?? keyFile, 'keyFile'),
      readPem(cert ?? certFile, 'certFile'),
    );
    const services = loadServices(protosDir);
    const channelOpts = {
      'grpc.primary_user_agent': 'tokensvc-node/0.1.0',
      ...(serverName ? { 'grpc.ssl_target_name_override': serverName, 'grpc.default_authority': serverName } : {}),
      ...channelOptions,
    };
    this.target = target;
    this.deadlineMs = deadlineMs;
    this._capability = capability;
    this._channel = new grpc.Channel(target, credentials, channelOpts);
    const stubOptions = { channelOverride: this._channel };
    this._capabilities = new services.CapabilityService(target, credentials, stubOptions);
    this._memory = new services.MemoryService(target, credentials, stubOptions);
  }

  /** Close the channel; calls in flight are cancelled. */
  close() {
    this._capabilities.close();
    this._memory.close();
    this._channel.close();
  }

  async _metadata(capability) {
    const token = typeof capability === 'function' ? await capability() : capability;
    if (typeof token !== 'string' || token.length === 0) {
      throw new TypeError('the capability must be a non-empty string');
    }
    const metadata = new grpc.Metadata();
    metadata.set('authorization', `Bearer ${token}`);
    return metadata;
  }

  /** Call one unary RPC with the capability and a deadline; failures become TokensvcError. */
  async _call(stub, method, request, { deadlineMs, capability, signal } = {}) {
    const metadata = await this._metadata(capability ?? this._capability);
    const deadline = Date.now() + (deadlineMs ?? this.deadlineMs);
    return new Promise((resolve, reject) => {
      const call = stub[method](request, metadata, { deadline }, (error, response) => {
        signal?.removeEventListener('abort', onAbort);
        if (error) {
          reject(typeof error.code === 'number' ? fromServiceError(error) : error);
        } else {
          resolve(response);
        }
      });
      function onAbort() {
        call.cancel();
      }
      if (signal?.aborted) {
        call.cancel();
      } else {
        signal?.addEventListener('abort', onAbort, { once: true });
      }
    });
  }

  // --- CapabilityService ------------------------------------------------------------------------

  /** The verified scope of the capability: `{namespace, agent, bucketId, perUser, registry, ...}`. */
  async verifyCapability(callOptions) {
    const response = await this._call(this._capabilities, 'verifyCapability', {}, callOptions);
    return fromScope(response.scope);
  }

  /**
   * The session-memory key of a conversation: `{key, effectiveScope, downgraded, perUser,
   * maxHistoryMessages, maxRetainedEntries, ttlSeconds, ttlRefreshedOnWrite, previousKeys}`.
   *
   * @param {string} conversationId
   * @param {'session'|'shared'} [scope]
   */
  async deriveSessionKey(conversationId, scope = 'session', callOptions) {
    const response = await this._call(
      this._capabilities,
      'deriveSessionKey',
      { conversationId, scope: toSessionScope(scope) },
      callOptions,
    );
    return {
      key: response.key,
      effectiveScope: fromSessionScope(response.effectiveScope),
      downgraded: response.downgraded,
      perUser: response.perUser,
      maxHistoryMessages: response.maxHistoryMessages,
      maxRetainedEntries: response.maxRetainedEntries,
      ttlSeconds: fromDuration(response.ttl),
      ttlRefreshedOnWrite: response.ttlRefreshedOnWrite,
      previousKeys: [...response.previousKeys],
    };
  }

  // --- MemoryService ----------------------------------------------------------------------------

  /**
   * Store 1 to 256 memories (all or nothing). Each item is a string or
   * `{content, metadata?, idempotencyKey?, ttlSeconds?}`; metadata values are strings, numbers or
   * booleans. Returns one `{id, deduplicated}` per item, in order.
   */
  async remember(items, callOptions) {
    if (!Array.isArray(items)) {
      throw new TypeError('remember takes an array of items');
    }
    const request = {
      items: items.map((item) => {
        const { content, metadata, idempotencyKey = '', ttlSeconds } = typeof item === 'string' ? { content: item } : item;
        return { content, metadata: toMetadataMap(metadata), idempotencyKey, ttl: toDuration(ttlSeconds) };
      }),
    };
    const response = await this._call(this._memory, 'remember', request, callOptions);
    return response.results.map(({ id, deduplicated }) => ({ id, deduplicated }));
  }

  /**
   * The memories closest in meaning to `query` (a string, or a Float32Array / Buffer embedding),
   * best first: `[{memory, score, vectorRank, textRank}]`.
   *
   * @param {string | Float32Array | Uint8Array} query
   * @param {object} [options]
   * @param {number} [options.topK] 1..100 (server default 10)
   * @param {number} [options.minScore]
   * @param {object} [options.filter] `{key, op, value}`, `{and: [...]}`, `{or: [...]}`, `{not: f}`
   * @param {'vector'|'hybrid'|'text'} [options.mode] unset: hybrid for text, vector for an embedding
   */
  async searchMemories(query, { topK = 0, minScore, filter, mode, ...callOptions } = {}) {
    const request = { topK, filter: toFilter(filter), mode: toSearchMode(mode) };
    if (typeof query === 'string') {
      request.queryText = query;
    } else if (query instanceof Float32Array) {
      request.queryVector = Buffer.from(query.buffer, query.byteOffset, query.byteLength);
    } else if (query instanceof Uint8Array) {
      request.queryVector = Buffer.from(query);
    } else {
      throw new TypeError('query must be a string or an embedding (Float32Array or bytes)');
    }
    if (minScore !== undefined) {
      request.minScore = minScore;
    }
    const response = await this._call(this._memory, 'searchMemories', request, callOptions);
    return response.results.map((result) => ({
      memory: fromMemory(result.memory),
      score: result.score,
      vectorRank: result.vectorRank,
      textRank: result.textRank,
    }));
  }

  /** One memory by id. */
  async getMemory(id, callOptions) {
    const response = await this._call(this._memory, 'getMemory', { id }, callOptions);
    return fromMemory(response.memory);
  }

  /** One page of memories, newest first: `{memories, nextPageToken}`. */
  async listMemories({ pageSize = 0, pageToken = '', filter, ...callOptions } = {}) {
    const response = await this._call(
      this._memory,
      'listMemories',
      { pageSize, pageToken, filter: toFilter(filter) },
      callOptions,
    );
    return { memories: response.memories.map(fromMemory), nextPageToken: response.nextPageToken };
  }

  /** Delete memories by id; returns how many were deleted. */
  async forget(ids, callOptions) {
    const response = await this._call(this._memory, 'forget', { ids }, callOptions);
    return Number(response.forgottenCount);
  }

  /** Delete every memory of the capability's bucket; returns how many were deleted. */
  async forgetAll(callOptions) {
    const response = await this._call(this._memory, 'forgetAll', {}, callOptions);
    return Number(response.forgottenCount);
  }
}

export default { createClient, TokensvcError };
