package tokensvc_test

// The Go client against a LIVE tokensvc over mTLS. tests/clients/test_go_client.py starts an
// in-process server and runs `go test` with the connection in the environment; point it at
// `tokensvc dev` by hand the same way:
//
//	TOKENSVC_TARGET                 host:port
//	TOKENSVC_CA                     the CA bundle (PEM)
//	TOKENSVC_CERT, TOKENSVC_KEY     the launcher's certificate and key (dev-agent in default)
//	TOKENSVC_ADMIN_CERT, _KEY       an admin's certificate and key (creates the knowledge base)
//	TOKENSVC_CAPABILITY             a capability for default/dev-agent with long-term memory and
//	                                the knowledge base TOKENSVC_KNOWLEDGE_BASE in its roster
//	OTHER_AGENT_CAPABILITY          a capability for another agent (the certificate is dev-agent's)
//	TOKENSVC_KNOWLEDGE_BASE         a knowledge base ref the test may create and delete
//	TOKENSVC_SERVER_CERT, _KEY      the server's certificate and key (retry_test.go serves with them)
//	GRPC_GO_RETRY=on                with grpc-go before 1.40 (retry_test.go)

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	tokensvc "github.com/ctxmesh/tokensvc/clients/go"
	tokensvcv1 "github.com/ctxmesh/tokensvc/clients/go/gen/tokensvc/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

var required = []string{
	"TOKENSVC_TARGET", "TOKENSVC_CA", "TOKENSVC_CERT", "TOKENSVC_KEY", "TOKENSVC_ADMIN_CERT",
	"TOKENSVC_ADMIN_KEY", "TOKENSVC_CAPABILITY", "OTHER_AGENT_CAPABILITY", "TOKENSVC_KNOWLEDGE_BASE",
}

func TestMain(m *testing.M) {
	var missing []string
	for _, name := range required {
		if os.Getenv(name) == "" {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		// A live test that cannot reach a server must fail, never pass vacuously.
		fmt.Fprintf(os.Stderr, "the live tests need a running tokensvc; set %s\n", strings.Join(missing, ", "))
		os.Exit(2)
	}
	os.Exit(m.Run())
}

func dial(t *testing.T, capability string, change func(*tokensvc.Config)) *tokensvc.Client {
	t.Helper()
	config := tokensvc.Config{
		Target:   os.Getenv("TOKENSVC_TARGET"),
		CAFile:   os.Getenv("TOKENSVC_CA"),
		CertFile: os.Getenv("TOKENSVC_CERT"),
		KeyFile:  os.Getenv("TOKENSVC_KEY"),
	}
	if capability != "" {
		config.Capability = tokensvc.StaticCapability(capability)
	}
	if change != nil {
		change(&config)
	}
	client, err := tokensvc.Dial(context.Background(), config)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	t.Cleanup(func() { client.Close() })
	return client
}

func launcher(t *testing.T) *tokensvc.Client {
	return dial(t, os.Getenv("TOKENSVC_CAPABILITY"), nil)
}

func admin(t *testing.T) *tokensvc.Client {
	return dial(t, "", func(c *tokensvc.Config) {
		c.CertFile, c.KeyFile = os.Getenv("TOKENSVC_ADMIN_CERT"), os.Getenv("TOKENSVC_ADMIN_KEY")
	})
}

func expectError(t *testing.T, err error, code codes.Code, reason string) *tokensvc.Error {
	t.Helper()
	if err == nil {
		t.Fatalf("expected %s (%s), the call succeeded", code, reason)
	}
	e, ok := tokensvc.AsError(err)
	if !ok {
		t.Fatalf("expected a *tokensvc.Error, got %T: %v", err, err)
	}
	if e.Code != code || e.Reason != reason {
		t.Fatalf("expected %s with reason %q, got %s with reason %q: %s", code, reason, e.Code, e.Reason, e.Message)
	}
	if status.Code(err) != code {
		t.Fatalf("status.Code(err) = %s, want %s", status.Code(err), code)
	}
	return e
}

func TestRememberAndSearchByMeaning(t *testing.T) {
	client := launcher(t)
	ctx := context.Background()
	marker := fmt.Sprintf("go-%d", time.Now().UnixNano())
	fact := "The quarterly board meeting of the Lisbon office is on the first Monday of March"
	remembered, err := client.Memory.Remember(ctx, &tokensvcv1.RememberRequest{Items: []*tokensvcv1.RememberItem{{
		Content: fact + " (" + marker + ")",
		Metadata: map[string]*tokensvcv1.MetadataValue{
			"run": {Kind: &tokensvcv1.MetadataValue_StringValue{StringValue: marker}},
		},
	}}})
	if err != nil {
		t.Fatalf("Remember: %v", err)
	}
	if len(remembered.GetResults()) != 1 {
		t.Fatalf("Remember answered %v", remembered.GetResults())
	}
	id := remembered.GetResults()[0].GetId()
	t.Cleanup(func() {
		if _, err := client.Memory.Forget(context.Background(), &tokensvcv1.ForgetRequest{Ids: []string{id}}); err != nil {
			t.Errorf("Forget: %v", err)
		}
	})

	// Found by meaning: a paraphrase sharing no content word but "meeting".
	found, err := client.Memory.SearchMemories(ctx, &tokensvcv1.SearchMemoriesRequest{
		Query: &tokensvcv1.SearchMemoriesRequest_QueryText{QueryText: "when do the directors get together in Portugal"},
		TopK:  3,
		Mode:  tokensvcv1.SearchMode_SEARCH_MODE_VECTOR,
		Filter: &tokensvcv1.Filter{Node: &tokensvcv1.Filter_Field{Field: &tokensvcv1.FieldFilter{
			Key: "run", Operator: tokensvcv1.FilterOperator_FILTER_OPERATOR_EQ,
			Value: &tokensvcv1.MetadataValue{Kind: &tokensvcv1.MetadataValue_StringValue{StringValue: marker}},
		}}},
	})
	if err != nil {
		t.Fatalf("SearchMemories: %v", err)
	}
	results := found.GetResults()
	if len(results) != 1 || results[0].GetMemory().GetId() != id {
		t.Fatalf("expected the remembered memory %s alone, got %v", id, results)
	}
	if score := results[0].GetScore(); score <= 0 || score > 1 {
		t.Fatalf("score %v outside (0, 1]", score)
	}
}

func TestKnowledgeUploadAndSearchWithCitation(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	manager := admin(t)
	ref := os.Getenv("TOKENSVC_KNOWLEDGE_BASE")
	if _, err := manager.Knowledge.CreateKnowledgeBase(ctx, &tokensvcv1.CreateKnowledgeBaseRequest{
		Namespace: "default", Ref: ref, DisplayName: "Go client live test",
		Chunking: &tokensvcv1.ChunkingStrategy{Kind: tokensvcv1.ChunkingKind_CHUNKING_KIND_MARKDOWN, ChunkSize: 64},
	}); err != nil {
		t.Fatalf("CreateKnowledgeBase: %v", err)
	}
	t.Cleanup(func() {
		if _, err := manager.Knowledge.DeleteKnowledgeBase(context.Background(),
			&tokensvcv1.DeleteKnowledgeBaseRequest{Namespace: "default", Ref: ref}); err != nil {
			t.Errorf("DeleteKnowledgeBase: %v", err)
		}
	})
	document := strings.Join([]string{
		"# Operations handbook", "",
		"## Backups", "",
		"Nightly backups of the ledger database run at 02:30 UTC and are kept for 35 days.", "",
		"## Incidents", "",
		"Page the on-call engineer through the escalation rota when an alert fires twice in an hour.", "",
	}, "\n")
	uploaded, err := manager.UploadDocument(ctx, &tokensvcv1.UploadDocumentHeader{
		Namespace: "default", KnowledgeBaseRef: ref, DocumentRef: "handbook.md",
		ContentType: "text/markdown", WaitUntilReady: true,
	}, strings.NewReader(document))
	if err != nil {
		t.Fatalf("UploadDocument: %v", err)
	}
	if state := uploaded.GetDocument().GetState(); state != tokensvcv1.DocumentState_DOCUMENT_STATE_READY {
		t.Fatalf("the document is %s after a wait-until-ready upload", state)
	}

	found, err := launcher(t).Knowledge.SearchKnowledge(ctx, &tokensvcv1.SearchKnowledgeRequest{
		KnowledgeBaseRefs: []string{ref}, QueryText: "how long do we keep backups", TopK: 1,
	})
	if err != nil {
		t.Fatalf("SearchKnowledge: %v", err)
	}
	if len(found.GetPassages()) != 1 {
		t.Fatalf("expected one passage, got %v", found.GetPassages())
	}
	passage := found.GetPassages()[0]
	if !strings.HasPrefix(passage.GetCitation(), "handbook.md#") || !strings.Contains(passage.GetText(), "35 days") {
		t.Fatalf("expected the backups passage cited in handbook.md, got %q: %q", passage.GetCitation(), passage.GetText())
	}
	if got := strings.Join(passage.GetHeadingPath(), " > "); got != "Operations handbook > Backups" {
		t.Fatalf("heading path %q", got)
	}
	// The citation's offsets (in characters) point into the extracted text GetDocument returns.
	stored, err := manager.Knowledge.GetDocument(ctx, &tokensvcv1.GetDocumentRequest{
		Namespace: "default", KnowledgeBaseRef: ref, DocumentRef: "handbook.md", IncludeText: true,
	})
	if err != nil {
		t.Fatalf("GetDocument: %v", err)
	}
	text := []rune(stored.GetDocument().GetText())
	start, end := passage.GetStartOffset(), passage.GetEndOffset()
	if start < 0 || end > int32(len(text)) || start >= end || !strings.Contains(string(text[start:end]), "35 days") {
		t.Fatalf("offsets [%d, %d) do not cite the passage in the %d-character text", start, end, len(text))
	}
}

func TestDeriveSessionKey(t *testing.T) {
	derived, err := launcher(t).Capability.DeriveSessionKey(context.Background(), &tokensvcv1.DeriveSessionKeyRequest{
		ConversationId: "conv-42",
		Scope:          tokensvcv1.SessionScope_SESSION_SCOPE_SESSION,
	})
	if err != nil {
		t.Fatalf("DeriveSessionKey: %v", err)
	}
	if derived.GetKey() != "mem:default/dev-agent:conv-42" || derived.GetDowngraded() {
		t.Fatalf("derived %q (downgraded %v)", derived.GetKey(), derived.GetDowngraded())
	}
}

func TestABadCapabilityIsRefusedWithItsReason(t *testing.T) {
	ctx := context.Background()
	request := &tokensvcv1.VerifyCapabilityRequest{}
	_, err := dial(t, "not.a.capability", nil).Capability.VerifyCapability(ctx, request)
	expectError(t, err, codes.Unauthenticated, "CAPABILITY_INVALID")

	_, err = dial(t, os.Getenv("OTHER_AGENT_CAPABILITY"), nil).Capability.VerifyCapability(ctx, request)
	expectError(t, err, codes.PermissionDenied, "BINDING_MISMATCH")

	_, err = dial(t, "", nil).Memory.Remember(ctx, &tokensvcv1.RememberRequest{})
	expectError(t, err, codes.Unauthenticated, "CAPABILITY_MISSING")
}

func TestInvalidArgumentNamesTheField(t *testing.T) {
	_, err := launcher(t).Memory.Remember(context.Background(), &tokensvcv1.RememberRequest{
		Items: []*tokensvcv1.RememberItem{{Content: "kept"}, {Content: ""}},
	})
	e := expectError(t, err, codes.InvalidArgument, "INVALID_ARGUMENT")
	if e.Field != "items[1].content" || e.RequestID == "" {
		t.Fatalf("field %q, request id %q", e.Field, e.RequestID)
	}
}

func TestDeadlines(t *testing.T) {
	// The client's default deadline applies to a call whose context has none: a search (which
	// embeds its query) cannot finish within a microsecond.
	hurried := dial(t, os.Getenv("TOKENSVC_CAPABILITY"), func(c *tokensvc.Config) { c.Timeout = time.Microsecond })
	_, err := hurried.Memory.SearchMemories(context.Background(), &tokensvcv1.SearchMemoriesRequest{
		Query: &tokensvcv1.SearchMemoriesRequest_QueryText{QueryText: "anything"},
	})
	e := expectError(t, err, codes.DeadlineExceeded, "")
	if e.Retryable() {
		t.Fatalf("a passed deadline is not retryable")
	}

	// The caller's own deadline wins over the default: the same client, given time, gets through.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := hurried.Capability.VerifyCapability(ctx, &tokensvcv1.VerifyCapabilityRequest{}); err != nil {
		t.Fatalf("VerifyCapability within the caller's 30 s: %v", err)
	}
	// And a caller's deadline that passes is DEADLINE_EXCEEDED, without a reason.
	ctx, cancel = context.WithTimeout(context.Background(), time.Microsecond)
	defer cancel()
	_, err = launcher(t).Capability.VerifyCapability(ctx, &tokensvcv1.VerifyCapabilityRequest{})
	expectError(t, err, codes.DeadlineExceeded, "")
}
