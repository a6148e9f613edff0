// Typed errors: every failed tokensvc call becomes a TokensvcError carrying the gRPC status name
// and the google.rpc.ErrorInfo reason the server sends in the `grpc-status-details-bin` trailer.
//
// The trailer is a serialized google.rpc.Status whose `details` are google.protobuf.Any messages.
// They are decoded with protobufjs from Google's own status.proto and error_details.proto, as
// shipped by the `google-proto-files` package (no hand-written wire decoding).

import path from 'node:path';

import * as grpc from '@grpc/grpc-js';
import { getProtoPath } from 'google-proto-files';
import protobuf from 'protobufjs';

/** The ErrorInfo domain tokensvc uses for every error it sends. */
export const ERROR_DOMAIN = 'tokensvc.ctxmesh.ai';

const STATUS_DETAILS_KEY = 'grpc-status-details-bin';
const TYPE_URL_PREFIX = 'type.googleapis.com/';

let rpcRoot;

/** The protobufjs Root holding google.rpc.Status and the google.rpc error detail messages. */
function googleRpcRoot() {
  if (rpcRoot === undefined) {
    const includeDir = path.dirname(getProtoPath()); // the directory that holds `google/`
    const root = new protobuf.Root();
    root.resolvePath = (_origin, target) => (path.isAbsolute(target) ? target : path.join(includeDir, target));
    // keepCase: the bundled google.protobuf.Any is snake_case (`type_url`) whatever the option, so
    // every google.rpc message keeps its .proto field names too, for one consistent spelling.
    root.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], { keepCase: true });
    root.resolveAll();
    rpcRoot = root;
  }
  return rpcRoot;
}

/**
 * Decode a serialized google.rpc.Status into `{code, message, details}`, where each detail is
 * `{type, value}`: `type` the full message name (for example `google.rpc.ErrorInfo`) and `value`
 * the decoded message as a plain object with the .proto field names (for example
 * `field_violations`), or the raw bytes when the type is not a google.rpc detail.
 *
 * @param {Uint8Array} bytes
 */
export function decodeStatus(bytes) {
  const root = googleRpcRoot();
  const Status = root.lookupType('google.rpc.Status');
  const status = Status.toObject(Status.decode(bytes), { defaults: true, longs: String });
  const details = status.details.map((any) => {
    const typeUrl = any.type_url;
    const type = typeUrl.startsWith(TYPE_URL_PREFIX) ? typeUrl.slice(TYPE_URL_PREFIX.length) : typeUrl;
    let messageType = null;
    try {
      messageType = root.lookupType(type);
    } catch {
      // Not a google.rpc detail this client knows: keep the bytes.
    }
    const value = messageType
      ? messageType.toObject(messageType.decode(any.value), { defaults: true, longs: String })
      : any.value;
    return { type, value };
  });
  return { code: status.code, message: status.message, details };
}

/** An error returned by tokensvc (or by the transport on the way to it). */
export class TokensvcError extends Error {
  /**
   * @param {object} init
   * @param {string} init.message the human-readable status message (do not branch on it)
   * @param {string} init.code the gRPC status name, for example `PERMISSION_DENIED`
   * @param {number} init.grpcCode the numeric gRPC status code
   * @param {string|null} init.reason the ErrorInfo reason, for example `BINDING_MISMATCH`; null
   *   when the failure carried no ErrorInfo (for example a transport failure)
   * @param {string|null} init.domain the ErrorInfo domain (`tokensvc.ctxmesh.ai`)
   * @param {Record<string,string>} init.metadata the ErrorInfo metadata, for example `{field: 'items[0].content'}`
   * @param {string[]} init.fieldViolations the BadRequest field paths of an INVALID_ARGUMENT
   * @param {Array<{type: string, value: unknown}>} init.details every decoded status detail
   * @param {grpc.Metadata|undefined} init.trailers the call's trailing metadata
   * @param {unknown} [init.cause] the underlying @grpc/grpc-js error
   */
  constructor({ message, code, grpcCode, reason, domain, metadata, fieldViolations, details, trailers, cause }) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = 'TokensvcError';
    this.code = code;
    this.grpcCode = grpcCode;
    this.reason = reason;
    this.domain = domain;
    this.metadata = metadata;
    this.fieldViolations = fieldViolations;
    this.details = details;
    this.trailers = trailers;
  }

  /** True for the errors tokensvc documents as safe to retry with backoff. */
  get retryable() {
    return this.code === 'UNAVAILABLE' || this.code === 'RESOURCE_EXHAUSTED' || this.code === 'ABORTED';
  }
}

/**
 * Turn a @grpc/grpc-js ServiceError into a TokensvcError, decoding the rich status details.
 *
 * @param {import('@grpc/grpc-js').ServiceError} error
 * @returns {TokensvcError}
 */
export function fromServiceError(error) {
  const grpcCode = typeof error.code === 'number' ? error.code : grpc.status.UNKNOWN;
  let reason = null;
  let domain = null;
  let metadata = {};
  let fieldViolations = [];
  let details = [];
  const raw = error.metadata instanceof grpc.Metadata ? error.metadata.get(STATUS_DETAILS_KEY) : [];
  if (raw.length > 0 && raw[0] instanceof Uint8Array) {
    try {
      ({ details } = decodeStatus(raw[0]));
    } catch (decodeError) {
      details = [{ type: 'undecodable', value: String(decodeError) }];
    }
    for (const { type, value } of details) {
      if (type === 'google.rpc.ErrorInfo' && reason === null) {
        reason = value.reason || null;
        domain = value.domain || null;
        metadata = { ...value.metadata };
      } else if (type === 'google.rpc.BadRequest') {
        fieldViolations = value.field_violations.map((violation) => violation.field);
      }
    }
  }
  return new TokensvcError({
    message: error.details || error.message,
    code: grpc.status[grpcCode] ?? String(grpcCode),
    grpcCode,
    reason,
    domain,
    metadata,
    fieldViolations,
    details,
    trailers: error.metadata,
    cause: error,
  });
}
