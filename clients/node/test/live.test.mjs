// The Node client against a LIVE tokensvc over mTLS: remember, search, derive a session key, and
// a PERMISSION_DENIED with its ErrorInfo reason.
//
// Connection info comes from the environment (tests/clients/test_node_client.py sets it against an
// in-process server; point it at `make dev` by hand the same way):
//   TOKENSVC_TARGET   host:port              TOKENSVC_CA, TOKENSVC_CERT, TOKENSVC_KEY  PEM files
//   TOKENSVC_CAPABILITY              a capability for namespace `default`, agent `dev-agent`, --ltm
//   OTHER_AGENT_CAPABILITY  a capability for another agent (the certificate is dev-agent's)
//
//   node --test clients/node/test/live.test.mjs

import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, test } from 'node:test';

import { createClient, ERROR_DOMAIN, TokensvcError } from '../src/index.js';

const REQUIRED = [
  'TOKENSVC_TARGET',
  'TOKENSVC_CA',
  'TOKENSVC_CERT',
  'TOKENSVC_KEY',
  'TOKENSVC_CAPABILITY',
  'OTHER_AGENT_CAPABILITY',
];
const missing = REQUIRED.filter((name) => !process.env[name]);
if (missing.length > 0) {
  // A live test that cannot reach a server must fail, never pass vacuously.
  throw new Error(`live test needs a running tokensvc; set ${missing.join(', ')}`);
}

const connection = {
  target: process.env.TOKENSVC_TARGET,
  caFile: process.env.TOKENSVC_CA,
  certFile: process.env.TOKENSVC_CERT,
  keyFile: process.env.TOKENSVC_KEY,
};

describe('tokensvc Node client against a live server', () => {
  let client;
  let otherAgent;
  const marker = randomUUID();
  const remembered = []; // ids to forget at the end: the dev-agent bucket is shared with other tests

  before(() => {
    client = createClient({ ...connection, capability: process.env.TOKENSVC_CAPABILITY });
    otherAgent = createClient({ ...connection, capability: process.env.OTHER_AGENT_CAPABILITY });
  });

  after(async () => {
    if (remembered.length > 0) {
      await client.forget(remembered).catch(() => {});
    }
    client?.close();
    otherAgent?.close();
  });

  test('verifies its capability', async () => {
    const scope = await client.verifyCapability();
    assert.equal(scope.namespace, 'default');
    assert.equal(scope.agent, 'dev-agent');
    assert.equal(scope.longTermMemory, true);
    assert.match(scope.bucketId, /^v\d+\.[a-z2-7]+$/);
    assert.ok(scope.expiresAt instanceof Date && scope.expiresAt > new Date());
  });

  test('remembers a fact and finds it by searching', async () => {
    const fact = `The deploy window for release ${marker} is Tuesday 14:00 UTC`;
    const [stored] = await client.remember([{ content: fact, metadata: { topic: 'ops', run: marker, priority: 2 } }]);
    assert.match(stored.id, /^[0-9a-f-]{36}$/);
    remembered.push(stored.id);
    assert.equal(stored.deduplicated, false);

    const again = await client.remember([fact]);
    assert.deepEqual(again, [{ id: stored.id, deduplicated: true }]);

    const results = await client.searchMemories(fact, { topK: 5 });
    assert.ok(results.length > 0, 'search returned nothing');
    assert.equal(results[0].memory.id, stored.id);
    assert.equal(results[0].memory.content, fact);
    assert.deepEqual(results[0].memory.metadata, { topic: 'ops', run: marker, priority: 2 });
    assert.ok(results[0].memory.createdAt instanceof Date);

    const filtered = await client.searchMemories('when can we deploy', {
      topK: 3,
      filter: { and: [{ key: 'run', op: 'EQ', value: marker }, { key: 'priority', op: 'GTE', value: 1 }] },
    });
    assert.deepEqual(
      filtered.map((result) => result.memory.id),
      [stored.id],
    );
  });

  test('derives the session key of a conversation', async () => {
    const conversationId = `conv-${marker}`;
    const session = await client.deriveSessionKey(conversationId);
    assert.equal(session.key, `mem:default/dev-agent:${conversationId}`);
    assert.equal(session.effectiveScope, 'session');
    assert.equal(session.downgraded, false);
    assert.equal(session.perUser, false);
    assert.equal(session.ttlSeconds, 24 * 3600);

    const shared = await client.deriveSessionKey(conversationId, 'shared');
    assert.equal(shared.key, session.key); // no registry: the private layout, downgraded
    assert.equal(shared.downgraded, true);
  });

  test("another agent's capability is PERMISSION_DENIED with reason BINDING_MISMATCH", async () => {
    for (const attempt of [() => otherAgent.verifyCapability(), () => otherAgent.remember(['must not be stored'])]) {
      await assert.rejects(attempt, (error) => {
        assert.ok(error instanceof TokensvcError, `expected a TokensvcError, got ${error}`);
        assert.equal(error.code, 'PERMISSION_DENIED');
        assert.equal(error.reason, 'BINDING_MISMATCH');
        assert.equal(error.domain, ERROR_DOMAIN);
        assert.equal(typeof error.message, 'string');
        return true;
      });
    }
  });

  test('an invalid argument names the field in the ErrorInfo metadata', async () => {
    await assert.rejects(
      () => client.deriveSessionKey('not/allowed'),
      (error) => {
        assert.ok(error instanceof TokensvcError);
        assert.equal(error.code, 'INVALID_ARGUMENT');
        assert.equal(error.reason, 'INVALID_ARGUMENT');
        assert.equal(error.metadata.field, 'conversation_id');
        assert.deepEqual(error.fieldViolations, ['conversation_id']);
        return true;
      },
    );
  });

  test('forgets what it remembered; a forgotten memory is NOT_FOUND', async () => {
    assert.equal(remembered.length, 1, 'the remember test did not run first');
    const [id] = remembered;
    assert.equal((await client.getMemory(id)).id, id);
    assert.equal(await client.forget([id]), 1);
    remembered.length = 0;
    await assert.rejects(
      () => client.getMemory(id),
      (error) => error instanceof TokensvcError && error.code === 'NOT_FOUND' && error.reason === 'NOT_FOUND',
    );
  });
});
