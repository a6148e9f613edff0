package tokensvc_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"strings"

	tokensvc "github.com/ctxmesh/tokensvc/clients/go"
	tokensvcv1 "github.com/ctxmesh/tokensvc/clients/go/gen/tokensvc/v1"
)

// A launcher remembers a fact for its run and finds it again by meaning. (Compiled by `go test`,
// not run: it needs a server; live_test.go runs the same calls against one.)
func Example() {
	ctx := context.Background()
	client, err := tokensvc.Dial(ctx, tokensvc.Config{
		Target:     "tokensvc.ctxmesh-system:50051",
		CAFile:     "/var/run/ctxmesh/ca.pem",
		CertFile:   "/var/run/ctxmesh/launcher.pem",
		KeyFile:    "/var/run/ctxmesh/launcher-key.pem",
		Capability: tokensvc.StaticCapability(os.Getenv("CTXMESH_RUN_CAPABILITY")),
	})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()

	_, err = client.Memory.Remember(ctx, &tokensvcv1.RememberRequest{Items: []*tokensvcv1.RememberItem{
		{Content: "Priya is allergic to shellfish"},
	}})
	if err != nil {
		log.Fatalf("remember: %v (reason %s)", err, tokensvc.ReasonOf(err))
	}
	found, err := client.Memory.SearchMemories(ctx, &tokensvcv1.SearchMemoriesRequest{
		Query: &tokensvcv1.SearchMemoriesRequest_QueryText{QueryText: "what can't Priya eat"},
		TopK:  5,
	})
	if err != nil {
		log.Fatal(err)
	}
	for _, result := range found.GetResults() {
		fmt.Printf("%.3f %s\n", result.GetScore(), result.GetMemory().GetContent())
	}
}

// Passages of the run's knowledge bases, with their citations and where they are in the original.
func Example_searchKnowledge() {
	var client *tokensvc.Client // from tokensvc.Dial with the run's capability
	found, err := client.Knowledge.SearchKnowledge(context.Background(), &tokensvcv1.SearchKnowledgeRequest{
		QueryText: "how long are backups kept", // every base in the capability's roster
		TopK:      3,
	})
	if err != nil {
		log.Fatal(err)
	}
	for _, passage := range found.GetPassages() {
		location := passage.GetLocation()
		fmt.Printf("%s (pages %d-%d): %s\n", passage.GetCitation(), location.GetFirstPage(),
			location.GetLastPage(), passage.GetText())
	}
}

// The Valkey key of a conversation's session memory, derived from the run's capability.
func Example_deriveSessionKey() {
	var client *tokensvc.Client
	derived, err := client.Capability.DeriveSessionKey(context.Background(), &tokensvcv1.DeriveSessionKeyRequest{
		ConversationId: "conv-42",
		Scope:          tokensvcv1.SessionScope_SESSION_SCOPE_SESSION,
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(derived.GetKey(), derived.GetTtl().AsDuration())
}

// An admin streams a document into a knowledge base; ingestion goes on in the background.
func ExampleClient_UploadDocument() {
	var admin *tokensvc.Client // dialled with an admin's certificate, no capability
	file, err := os.Open("handbook.pdf")
	if err != nil {
		log.Fatal(err)
	}
	defer file.Close()
	uploaded, err := admin.UploadDocument(context.Background(), &tokensvcv1.UploadDocumentHeader{
		Namespace:        "default",
		KnowledgeBaseRef: "handbook",
		DocumentRef:      "handbook.pdf",
		ContentType:      "application/pdf",
	}, file)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(uploaded.GetDocument().GetState()) // DOCUMENT_STATE_PENDING
}

// Errors carry the code and the ErrorInfo reason and field: branch on those, never on the message.
func ExampleError() {
	var client *tokensvc.Client
	_, err := client.Memory.Remember(context.Background(), &tokensvcv1.RememberRequest{})
	if e, ok := tokensvc.AsError(err); ok {
		switch {
		case e.Reason == "CAPABILITY_EXPIRED":
			// ask the control plane for a new capability
		case e.Retryable():
			// back off and try again
		case strings.HasPrefix(e.Field, "items["):
			fmt.Println("fix the request:", e.Field, e.Message)
		}
	}
}
